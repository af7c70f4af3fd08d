"""The engine's own step programs for an accelerator this machine does not have
(`multiserve doctor --target`): the FORWARD program of a token bucket, the HEAD of a row
bucket (its logits program and the sampler program of its sampler rows), the FUSED decode
step (forward, logits head and sampler in one program) and the DECODE_STEPS program (K
decode steps of the fused step in one compiled loop, EngineConfig.decode_steps_per_dispatch) of
engine/device/step_functions.py, from abstract inputs shaped as
engine/device/step_programs.py shapes a bucket's (its padding inputs), with the target's
starting plan (model/target_export.py), on a mesh: this host's first device for
`jax.export` (replicated), or compile-only TPU devices for the TPU compiler
(model/target_compile.py), one program per engine over the mesh's devices."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multiserve.config import EngineConfig, ModelConfig
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.target_export import ExportResult, export_for

# the programs a step may run (programs.ProgramKind, the HEAD as its two programs;
# "steps": the DECODE_STEPS program)
KINDS = ("forward", "logits", "sampler", "fused", "steps")
# the names the command line took before (`--programs multi:16`), still read
DEPRECATED_KINDS = {"multi": "steps"}


@dataclass(frozen=True)
class StepProgram:
    """One program, ready to lower: the jitted function, its abstract arguments and its
    static keyword arguments; `size` its bucket (tokens, logits rows or sampler rows)."""

    kind: str
    size: int
    tokens: int
    rows: int
    scanned: bool
    fn: Any
    args: tuple[Any, ...]
    static: dict[str, Any]


def engine_programs(ec: EngineConfig, decode_steps: bool) -> list[tuple[str, int]]:
    """Every program an engine of `ec` compiles: a FORWARD per token bucket, a HEAD per
    row bucket (logits, then one sampler per sampler row count), a FUSED per fused step
    size and, with `decode_steps`, a DECODE_STEPS per fused step size."""
    from multiserve.engine.step_inputs.sampling_zeros import sampler_rows

    rows = ec.precompile_bs_paddings
    return ([("forward", t) for t in ec.precompile_token_paddings]
            + [("logits", r) for r in rows]
            + [("sampler", s) for s in sorted({sampler_rows(r) for r in rows})]
            + [("fused", b) for b in ec.fused_step_sizes]
            + ([("steps", b) for b in ec.fused_step_sizes] if decode_steps else []))


def step_programs(cfg: ModelConfig, dtype: str, plan: InvariancePlan, ec: EngineConfig,
                  mesh: Mesh, params: Any, which: Iterable[tuple[str, int]], *,
                  max_pages: int, num_pages: int, decode_steps: int) -> list[StepProgram]:
    """The programs `which` ((kind, size) of KINDS) of an engine of `ec` over `mesh`,
    with abstract compute `params` placed there, a pool of `num_pages` pages and page
    tables `max_pages` wide."""
    from multiserve.engine.device.step_functions import StepFunctions
    from multiserve.engine.step_inputs.packed import layout_of
    from multiserve.engine.step_inputs.program_inputs import (
        sampling_inputs,
        small_sampling_fields,
        step_inputs,
        step_tree,
    )
    from multiserve.engine.step_inputs.sampling_zeros import SamplingBatches
    from multiserve.engine.step_inputs.token_arrays import empty_step_arrays
    from multiserve.model.families import family_for
    from multiserve.model.layers.kv_pool import KVPool, pool_layout, pool_shape
    from multiserve.model.sharding import attention_sharded, kv_pool_sharding

    replicated = NamedSharding(mesh, PartitionSpec())
    layout = pool_layout(plan.attention.kernel)
    kv_sharding = kv_pool_sharding(cfg, mesh, layout)
    max_rows = max(ec.precompile_bs_paddings)
    family = family_for(cfg)
    fns = StepFunctions(family, cfg, plan, ec.page_size, ec.attention_block_size, max_rows,
                        replicated, kv_sharding)
    dt = jnp.dtype(dtype)

    def spec(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=replicated), tree)

    pool = jax.ShapeDtypeStruct(
        pool_shape(cfg, num_pages * ec.page_size, layout, attention_sharded(cfg, mesh)), dt,
        sharding=kv_sharding)
    kv = KVPool(k=pool, v=pool, layout=layout)
    prev = jax.ShapeDtypeStruct((max_rows,), jnp.int32, sharding=replicated)
    hidden = jax.ShapeDtypeStruct((max_rows, cfg.hidden_size), dt, sharding=replicated)
    row_ids = jax.ShapeDtypeStruct((max_rows,), jnp.int32, sharding=replicated)
    row_prev = jax.ShapeDtypeStruct((max_rows,), jnp.bool_, sharding=replicated)
    # the host batches' device zeros go to this host's CPU (their shapes are what counts:
    # compile-only devices hold no arrays), then `spec` places them on the mesh
    host = NamedSharding(Mesh(jax.devices("cpu")[:1], ("host",)), PartitionSpec())
    samplers = SamplingBatches(cfg.vocab_size, host)

    def forward_inputs(tokens: int) -> tuple[tuple[Any, ...], Any]:
        arrays = empty_step_arrays(tokens, min(tokens, max_rows), max_rows, max_pages)
        return (params, kv, prev, spec(step_inputs(arrays))), layout_of(step_tree(arrays))

    def sampling(rows: int) -> tuple[tuple[Any, ...], Any]:
        sb_host = samplers.build([], rows)
        return spec(sampling_inputs(sb_host)), layout_of(small_sampling_fields(sb_host))

    out = []
    for kind, size in which:
        if kind == "forward":
            inputs, layout = forward_inputs(size)
            out.append(StepProgram(kind, size, size, min(size, max_rows),
                                   family.scans(plan, size), fns.forward, inputs,
                                   {"layout": layout}))
        elif kind == "logits":
            out.append(StepProgram(kind, size, 0, size, False, fns.logits,
                                   (params, hidden, row_ids, row_prev), {"num_rows": size}))
        elif kind == "sampler":
            sb, layout = sampling(size)
            logits = jax.ShapeDtypeStruct((size, cfg.vocab_size), jnp.float32,
                                          sharding=replicated)
            ids = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)
            flags = jax.ShapeDtypeStruct((size,), jnp.bool_, sharding=replicated)
            out.append(StepProgram(kind, size, 0, size, False, fns.sample,
                                   (logits, ids, flags, *sb),
                                   {"layout": layout, "max_rows": max_rows}))
        elif kind in ("fused", "steps"):
            t_inputs, t_layout = forward_inputs(size)
            sb, s_layout = sampling(size)
            static = {"layout": t_layout, "sample_layout": s_layout, "num_rows": size}
            fn = fns.step
            if kind == "steps":
                fn, static = fns.decode_steps, {**static, "decode_steps": decode_steps}
            out.append(StepProgram(kind, size, size, size, family.scans(plan, size), fn,
                                   (*t_inputs, *sb), static))
        else:
            raise ValueError(f"not a step program kind: {kind!r} (one of {KINDS})")
    return out


def export_step_programs(cfg: ModelConfig, dtype: str, platform: str, plan: InvariancePlan,
                         ec: EngineConfig, *, forward_tokens: int, fused_rows: int,
                         max_pages: int, num_pages: int,
                         decode_steps: int) -> dict[str, ExportResult]:
    """{"forward": the FORWARD program of `forward_tokens` tokens, "fused": the FUSED
    step of `fused_rows` decode rows, "steps": the DECODE_STEPS program of `decode_steps`
    decode steps of that fused step}, each lowered for `platform` with `jax.export` (or its
    error), on this host's first device (replicated)."""
    from multiserve.model.abstract_params import abstract_params
    from multiserve.model.sharding import make_mesh

    mesh = make_mesh(jax.devices()[:1])
    params = abstract_params(cfg, dtype, plan, mesh).compute
    programs = step_programs(cfg, dtype, plan, ec, mesh, params,
                             [("forward", forward_tokens), ("fused", fused_rows),
                              ("steps", fused_rows)],
                             max_pages=max_pages, num_pages=num_pages,
                             decode_steps=decode_steps)
    return {p.kind: export_for(p.fn, platform, p.tokens, p.rows, p.scanned, p.args, p.static)
            for p in programs}
