"""A model's compute params as abstract shapes, without making a weight: their shapes,
dtypes and (on a mesh) shardings, and the bytes an engine would hold for them
(`multiserve doctor --target`: model/target_export.py, the compile report).

The bytes held are the unique buffers of the family's compute params and of the canonical
leaves an engine keeps beside them (`params_to_hold`): a compute leaf that IS a canonical
leaf (an untransposed stack, a tied head's embedding) is one buffer, however many times
the compute tree names it. Which leaves are the same buffer is read from the conversion's
traced program (an output that is an input, or another output, moved through unchanged),
so it is the family's own conversion, not a copy of its rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.plan import InvariancePlan


@dataclass(frozen=True)
class AbstractParams:
    """The compute params' abstract tree, and bytes: the checkpoint's (the canonical tree
    in the compute dtype), what an engine holds (module docstring), and that per chip."""

    compute: Any
    checkpoint_bytes: int
    held_bytes: int
    held_bytes_per_chip: int


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def _chip_bytes(a: Any) -> int:
    sharding = getattr(a, "sharding", None)
    shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
    return int(np.prod(shape)) * jnp.dtype(a.dtype).itemsize


def canonical_shapes(cfg: ModelConfig, dtype: Any, mesh: Any = None,
                     moe_sharding: str = "tensor") -> Any:
    """The canonical params (param_layout) as ShapeDtypeStructs of `dtype`, placed by the
    family's sharding rules on `mesh` (None: unplaced)."""
    from multiserve.model.loading.param_layout import param_shapes

    dt = jnp.dtype(dtype)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s), dt), param_shapes(cfg),
                          is_leaf=lambda s: isinstance(s, tuple))
    if mesh is None:
        return shapes
    from multiserve.model.sharding import param_shardings

    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, param_shardings(cfg, mesh, moe_sharding))


def abstract_params(cfg: ModelConfig, dtype: Any, plan: InvariancePlan, mesh: Any = None,
                    moe_sharding: str = "tensor") -> AbstractParams:
    """The compute params of `plan` for `cfg` in `dtype`, abstract (module docstring). On
    `mesh` every leaf carries the sharding the conversion gives it there (the compiler's
    propagation from the canonical leaves' placement, as the engine's conversion runs)."""
    from multiserve.model.families import family_for

    family = family_for(cfg)
    canonical = canonical_shapes(cfg, dtype, mesh, moe_sharding)
    sizes = tuple(t for t, _ in plan.attention.by_tokens)

    def convert(p: Any) -> tuple[Any, Any]:
        compute = family.compute_params(p, cfg, plan, sizes)
        return compute, family.params_to_hold(p, compute)

    traced = jax.jit(convert).trace(canonical)
    jaxpr = traced.jaxpr.jaxpr
    out_info = jax.tree.leaves(traced.out_info)
    n_compute = len(jax.tree.leaves(jax.eval_shape(lambda p: convert(p)[0], canonical)))
    if mesh is not None and mesh.size > 1:
        from multiserve.model.target_compile import no_persistent_cache

        with no_persistent_cache():
            shardings = jax.tree.leaves(traced.lower().compile().output_shardings)
    elif mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        shardings = [NamedSharding(mesh, PartitionSpec())] * len(out_info)
    else:
        shardings = [None] * len(out_info)
    outs = [jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s)
            for i, s in zip(out_info, shardings, strict=True)]
    held, per_chip, seen = 0, 0, set()
    for var, out in zip(jaxpr.outvars, outs, strict=True):
        key = id(var) if hasattr(var, "aval") and not hasattr(var, "val") else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        held += _nbytes(out)
        per_chip += _chip_bytes(out)
    compute_tree = jax.tree.structure(jax.eval_shape(lambda p: convert(p)[0], canonical))
    compute = jax.tree.unflatten(compute_tree, outs[:n_compute])
    checkpoint = sum(_nbytes(a) for a in jax.tree.leaves(canonical))
    return AbstractParams(compute, checkpoint, held, per_chip)
