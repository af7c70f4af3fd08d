"""RMSNorm whose every row's result is independent of the row count (its row sums follow
the invariance plan's RowSumPlan), in Llama's form and in Gemma's."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multiserve.model.invariance.plan import RowSumPlan
from multiserve.model.invariance.primitives import row_sum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plan: RowSumPlan,
             plus_one: bool = False, weight_f32: bool = False) -> jax.Array:
    """RMSNorm over the last axis; each row's result is independent of the row count
    (`row_sum` by the plan: XLA's own mean changes order with the operand's size).
    Llama's: the normed row rounded to x's dtype, then times `weight`. `plus_one`
    (Gemma's): times (1 + weight) in float32, then rounded once; `weight_f32` (GPT-OSS's):
    times weight in float32, then rounded once."""
    xf = x.astype(jnp.float32)
    var = row_sum(xf * xf, plan)[..., None] / x.shape[-1]
    normed = xf * jax.lax.rsqrt(var + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if weight_f32:
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return normed.astype(x.dtype) * weight

