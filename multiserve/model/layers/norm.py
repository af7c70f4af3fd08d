"""RMSNorm whose every row's result is independent of the row count (its row sums follow
the invariance plan's RowSumPlan), in Llama's form and in Gemma's.

XLA:CPU contracts an elementwise multiply and the add that consumes it into one FMA where
the two share a fusion, and which ops share a fusion changes with the program (the step's
size, scanned or unrolled layers). A norm whose output is added to the residual stream
(Gemma's post-block norms) therefore ends in a division (`rms_norm_for_add`): no program
can fuse it with the add, so every program rounds it alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multiserve.model.invariance.plan import RowSumPlan
from multiserve.model.invariance.primitives import row_sum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plan: RowSumPlan,
             plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis; each row's result is independent of the row count
    (`row_sum` by the plan: XLA's own mean changes order with the operand's size).
    Llama's: the normed row rounded to x's dtype, then times `weight`. `plus_one`
    (Gemma's): times (1 + weight) in float32, then rounded once."""
    xf = x.astype(jnp.float32)
    var = row_sum(xf * xf, plan)[..., None] / x.shape[-1]
    normed = xf * jax.lax.rsqrt(var + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return normed.astype(x.dtype) * weight


def rms_norm_for_add(x: jax.Array, weight: jax.Array, eps: float, plan: RowSumPlan,
                     plus_one: bool = False) -> jax.Array:
    """`rms_norm` for an output that is then added to something: x times its weight
    divided by the row's root mean square (the same value to rounding), its last operation
    a division, so that no program contracts it with the add (module docstring)."""
    xf = x.astype(jnp.float32)
    var = row_sum(xf * xf, plan)[..., None] / x.shape[-1]
    scale = 1.0 + weight.astype(jnp.float32) if plus_one else weight.astype(jnp.float32)
    return ((xf * scale) / jnp.sqrt(var + eps)).astype(x.dtype)
