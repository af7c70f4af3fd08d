"""The engine's own step programs lowered for an accelerator this machine does not have
(`multiserve doctor --target`): the FORWARD program of a token bucket, the FUSED decode
step (forward, logits head and sampler in one program) and the MULTI program (K turns of
the fused step in one compiled loop, EngineConfig.decode_steps_per_dispatch) of
engine/device/step_functions.py, exported with `jax.export` for the target platform from
abstract inputs shaped as engine/device/step_programs.py shapes a bucket's (its padding
inputs, one device, replicated), with the target's starting plan
(model/target_export.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import EngineConfig, ModelConfig
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.target_export import ExportResult, abstract_compute_params, export_for
from multiserve.model.sharding import AXIS


def export_step_programs(cfg: ModelConfig, dtype: str, platform: str, plan: InvariancePlan,
                         ec: EngineConfig, *, forward_tokens: int, fused_rows: int,
                         max_pages: int, num_pages: int,
                         multi_turns: int) -> dict[str, ExportResult]:
    """{"forward": the FORWARD program of `forward_tokens` tokens, "fused": the FUSED
    step of `fused_rows` decode rows, "multi": the MULTI program of `multi_turns` turns of
    that fused step}, each lowered for `platform` (or its error)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from multiserve.engine.device.batch_arrays import empty_step_arrays
    from multiserve.engine.device.packed_inputs import layout_of
    from multiserve.engine.device.sampling_batches import SamplingBatches
    from multiserve.engine.device.step_functions import StepFunctions
    from multiserve.engine.device.step_inputs import (
        sampling_inputs,
        small_sampling_fields,
        step_inputs,
        step_tree,
    )
    from multiserve.model.families import family_for
    from multiserve.model.layers.kv_pool import KVPool

    replicated = NamedSharding(Mesh(np.array(jax.devices()[:1]), (AXIS,)), PartitionSpec())
    max_rows = max(ec.precompile_bs_paddings)
    family = family_for(cfg)
    fns = StepFunctions(family, cfg, plan, ec.page_size, ec.attention_block_size, max_rows,
                        replicated, replicated)
    dt = jnp.dtype(dtype)

    def spec(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=replicated), tree)

    params = spec(abstract_compute_params(cfg, dt, plan))
    pool = jax.ShapeDtypeStruct(
        (cfg.num_layers, cfg.num_kv_heads, num_pages * ec.page_size, cfg.head_dim), dt,
        sharding=replicated)
    kv = KVPool(k=pool, v=pool)
    prev = jax.ShapeDtypeStruct((max_rows,), jnp.int32, sharding=replicated)

    def forward_inputs(tokens: int) -> tuple[tuple[Any, ...], Any]:
        arrays = empty_step_arrays(tokens, min(tokens, max_rows), max_rows, max_pages)
        return (params, kv, prev, spec(step_inputs(arrays))), layout_of(step_tree(arrays))

    inputs, layout = forward_inputs(forward_tokens)
    out = {"forward": export_for(fns.forward, platform, forward_tokens, max_rows,
                                 family.scans(plan, forward_tokens), inputs,
                                 {"layout": layout})}
    sb_host = SamplingBatches(cfg.vocab_size, replicated).build([], fused_rows)
    t_inputs, t_layout = forward_inputs(fused_rows)
    # the MULTI program takes the FUSED program's inputs and static arguments, plus `turns`
    fused_inputs = (*t_inputs, *spec(sampling_inputs(sb_host)))
    fused_static = {"layout": t_layout,
                    "sample_layout": layout_of(small_sampling_fields(sb_host)),
                    "num_rows": fused_rows}
    scanned = family.scans(plan, fused_rows)
    out["fused"] = export_for(fns.step, platform, fused_rows, fused_rows, scanned,
                              fused_inputs, fused_static)
    out["multi"] = export_for(fns.multi, platform, fused_rows, fused_rows, scanned,
                              fused_inputs, {**fused_static, "turns": multi_turns})
    return out
