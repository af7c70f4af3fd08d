"""RMSNorm whose every row's result is independent of the row count (its row sums follow
the invariance plan's RowSumPlan)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multiserve.model.invariance.plan import RowSumPlan
from multiserve.model.invariance.primitives import row_sum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plan: RowSumPlan) -> jax.Array:
    """RMSNorm over the last axis; each row's result is independent of the row count
    (`row_sum` by the plan: XLA's own mean changes order with the operand's size)."""
    xf = x.astype(jnp.float32)
    var = row_sum(xf * xf, plan)[..., None] / x.shape[-1]
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight
