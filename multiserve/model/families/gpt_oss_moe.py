"""GPT-OSS's mixture-of-experts MLP, with moe.py's invariance: every token's output bitwise
independent of the rest of the step.

Per sparse layer, for T tokens and top-k routing:
1. router logits x @ W_router + b (a row-invariant product, then the bias) [T, E];
2. the top-k logits and their experts (`lax.top_k`, exact), the weights a softmax over
   those k logits in float32 (max exact, a fixed-order sum over k);
3. the T*k pairs sorted by expert (stable: a permutation) and each row against its own
   expert's matrices (`primitives.grouped`: the plan's "native" grouped kernel or
   "gather"): gate and up come from ONE product with the fused matrix `we_gateup`
   [E, D, 2F] (transformers' layout: gate in the even columns, up in the odd ones), plus
   the expert's bias;
4. the clamped SwiGLU, in float32 and rounded once: gate <= limit, -limit <= up <= limit,
   (up + 1) * gate * sigmoid(alpha * gate);
5. the down product with the expert's down matrix, plus its bias; the pairs back in token
   order (an exact scatter) and combined by rank (y_1 w_1 + ... + y_k w_k).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig
from multiserve.model.families.moe import fixed_order_sum
from multiserve.model.invariance.plan import ProductPlan
from multiserve.model.invariance.primitives import grouped
from multiserve.model.tensor_parallel import TensorParallel, whole

EXPERT_MATRICES = ("we_gateup", "we_down")  # [E, in, out] per MoE layer
EXPERT_BIASES = ("be_gateup", "be_down")  # [E, out] per MoE layer


def route(logits: jax.Array, k: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] in `dtype`, experts [T, k] int32): the top-k logits, softmaxed over
    themselves in float32 (transformers' GptOssTopKRouter)."""
    top, experts = jax.lax.top_k(logits.astype(jnp.float32), k)
    shifted = jnp.exp(top - top[:, :1])  # top-k is sorted: the first is the max
    return (shifted / fixed_order_sum(shifted)[:, None]).astype(dtype), \
        experts.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), in
    float32, rounded once to gate's dtype."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return ((u + 1.0) * (g * jax.nn.sigmoid(g * alpha))).astype(gate.dtype)


def moe_mlp_routed(h: jax.Array, w: dict[str, jax.Array | None], moe_index: int,
                   proj: Any, cfg: ModelConfig, plans: dict[str, ProductPlan],
                   tp: TensorParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """(the sparse MLP's output [T, D], the experts each token chose [T, k] int32, in rank
    order) of normed hidden states h [T, D] (module docstring). `w`: this layer's router
    layouts (for `proj`), `router_b`, the expert matrices (`we_*` [E, K, N] for "gather",
    `we_*_p` the panels of every MoE layer for "native") and biases `be_*` [E, N];
    `moe_index`: the layer's ordinal among the MoE layers; `tp` as moe.moe_mlp_routed's."""
    t, k, e = h.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    weights, experts = route(proj(h, "router") + w["router_b"], k, h.dtype)
    pair_expert = experts.reshape(-1)  # [T*k], pair p = (token p // k, rank p % k)
    order = jnp.argsort(pair_expert, stable=True)
    groups = pair_expert[order]
    first = moe_index * e

    def expert_product(a: jax.Array, name: str) -> jax.Array:
        bias = w[f"b{name[1:]}"][groups]  # be_*: each row's own expert's bias
        return grouped(a, groups, w[name], w[f"{name}_p"], plans[name], first) + bias

    gate_up = whole(expert_product(h[order // k], "we_gateup"), tp)
    act = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], cfg.swiglu_limit,
                         cfg.swiglu_alpha)
    ys = whole(expert_product(act, "we_down"), tp)
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)
    out = ys[:, 0] * weights[:, 0, None]
    for j in range(1, k):
        out = out + ys[:, j] * weights[:, j, None]
    return out, experts
