"""The gated activation of every family's MLP: act(gate) * up, act silu (SwiGLU) or the
tanh-approximated gelu (GeGLU: Gemma's gelu_pytorch_tanh)."""

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


def gated(gate: jax.Array, up: jax.Array, hidden_act: str) -> jax.Array:
    """act(gate) * up for ModelConfig.hidden_act: "silu" (`swiglu`) or "gelu_tanh"
    (0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), computed and rounded as `swiglu`)."""
    if hidden_act == "silu":
        return swiglu(gate, up)
    assert hidden_act == "gelu_tanh", hidden_act
    act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
    return act * up
