"""The SwiGLU activation of every family's MLP: silu(gate) * up."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in gate's dtype. silu is computed in float32 and rounded once to that
    dtype, then the product rounded once, as transformers' bf16 kernels do (`jax.nn.silu`
    on a bf16 array rounds each of its five steps to bf16: less exact, and on XLA:CPU,
    without excess precision, a conversion pair per step). Float32 inputs: exactly
    `jax.nn.silu(gate) * up`."""
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return act * up
