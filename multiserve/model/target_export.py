"""Lowering the whole model forward for an accelerator this machine does not have
(`multiserve doctor --target cuda|tpu`): `jax.export` of model/families/forward.py for that
platform, with abstract params (no weights are made) and the invariance plan the target
would start from.

The target's plan (`target_plan`) is what is known without its device: the attention
kernel invariant by construction on that platform (layers/attention_pallas.py: "pallas_gpu"
on cuda, "pallas_tpu" on tpu; the choice the calibration makes there unless the kernel's
rows fail to verify), and for the products and row sums the formulation that reads the
canonical weights at every size, unpadded (the plain product; a tied head the NT product
against the embedding; a MoE family's expert products by the TPU's grouped matmul, else
"gather"), each weight held once
(`layer_copies` off): the device's own
probe decides those (plain or nt, and any padding), so the plan is marked unverified,
with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.plan import (
    AttentionPlan,
    Formulation,
    InvariancePlan,
    ProductPlan,
    RowSumPlan,
)
from multiserve.model.invariance.workload import Workload
from multiserve.model.kernels.grouped_tpu import gmm_usable

TARGET_ATTENTION = {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}  # jax.export platform -> kernel
# the custom-call target a Pallas kernel lowers to on each platform (no export compatibility
# guarantee: the exported program is for this jax version's runtime, a lowering check only)
PALLAS_CALL_TARGET = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def target_plan(workload: Workload, platform: str, tied_head: bool = False) -> InvariancePlan:
    """The plan an engine of `workload` starts from on `platform` ("cuda" or "tpu"), before
    its device calibrates it (module docstring). Every product reads its weights in the
    canonical layout, once: the layer matrices W [in, out] by the plain product, from
    static slices of their stacks (`layer_copies` off), and a head tied to the embedding
    (`tied_head`) by the NT product against the embedding [V, D] itself."""
    def kernel(name: str) -> str:
        return "nt" if name == "head" and tied_head else "plain"

    products = tuple(ProductPlan(u.name, u.k, u.n, tuple((m, Formulation(kernel(u.name), m))
                                                          for m in u.sizes))
                     for u in workload.products)
    # a MoE family's expert products: the TPU's grouped matmul where it runs
    # (kernels/grouped_tpu.py), else each row against its gathered matrix
    grouped = tuple(ProductPlan(g.name, g.k, g.n, tuple(
        (m, Formulation("gmm" if gmm_usable(platform, g.sharded) else "gather", m))
        for m in g.sizes)) for g in workload.grouped)
    row_sums = tuple(RowSumPlan(width, tuple((m, m) for m in counts))
                     for width, counts in workload.row_sums)
    sizes = workload.attention.sizes
    kernel = TARGET_ATTENTION[platform]  # each computes every attention term
    attention = AttentionPlan(tuple((t, (1, t)) for t in sizes), False, kernel)
    return InvariancePlan(products + grouped, row_sums, attention, verified=False, problems=(
        f"not calibrated: no {platform} device here; products and row sums are probed "
        "on the device (plain shown)",), layer_copies=False)


@dataclass(frozen=True)
class ExportResult:
    """One lowered forward: its step shape, the program's size, how many Pallas kernel
    calls it holds, or the error that stopped the lowering."""

    tokens: int
    rows: int
    scanned: bool
    mlir_chars: int = 0
    pallas_calls: int = 0
    error: str | None = None


def export_for(fn: Any, platform: str, tokens: int, rows: int, scanned: bool,
               args: tuple[Any, ...], static: dict[str, Any]) -> ExportResult:
    """`jax.export` of the jitted `fn` at abstract `args` (and static keyword arguments
    `static`) for `platform`; a lowering error is returned, not raised."""
    target = PALLAS_CALL_TARGET[platform]
    try:
        exported = jax.export.export(
            fn, platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
        )(*args, **static)
    except Exception as e:  # noqa: BLE001 (reported: the lowering's own message)
        return ExportResult(tokens, rows, scanned, error=f"{type(e).__name__}: {e}")
    text = exported.mlir_module()
    return ExportResult(tokens, rows, scanned, len(text),
                        text.count(f"stablehlo.custom_call @{target}("))


def export_forward(cfg: ModelConfig, dtype: Any, platform: str, plan: InvariancePlan, *,
                   tokens: int, rows: int, page_size: int, block_size: int,
                   max_pages: int, num_pages: int) -> ExportResult:
    """`jax.export` of the forward of one step (`tokens` new tokens, `rows` logit rows, a
    page table of `rows` sequences x `max_pages`) for `platform`, on abstract params in
    `dtype` and a pool of `num_pages` pages. A lowering error is returned, not raised."""
    from multiserve.model.abstract_params import abstract_params
    from multiserve.model.families import family_for
    from multiserve.model.families.forward import forward
    from multiserve.model.layers.forward_batch import ForwardBatch
    from multiserve.model.layers.kv_pool import KVPool, pool_layout, pool_shape

    dt = jnp.dtype(dtype)
    params = abstract_params(cfg, dt, plan).compute
    layout = pool_layout(plan.attention.kernel)
    shape = pool_shape(cfg, num_pages * page_size, layout)
    pool = KVPool(k=jax.ShapeDtypeStruct(shape, dt), v=jax.ShapeDtypeStruct(shape, dt),
                  layout=layout)
    i32 = np.int32
    batch = ForwardBatch(*(jax.ShapeDtypeStruct(s, i32) for s in (
        (tokens,), (tokens,), (tokens,), (tokens,), (rows, max_pages), (rows,), (rows,))))
    fn = jax.jit(partial(forward, cfg=cfg, page_size=page_size, attn_block_size=block_size,
                         plan=plan))
    return export_for(fn, platform, tokens, rows, family_for(cfg).scans(plan, tokens),
                      (params, pool, batch), {})
