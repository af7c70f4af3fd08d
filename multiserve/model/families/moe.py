"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE) whose every token's output is bitwise
independent of the rest of the step: of how many tokens share it, and of how many chose
the same experts.

For T tokens and top-k routing, one step computes:

1. router logits x @ W_router [T, E] (a row-invariant product, `primitives.dense`);
   softmax in float32 (max is exact; the sum over experts is a fixed left-to-right sum
   of E columns, elementwise across rows, so a row's sum never depends on T);
2. the top-k probabilities and experts per token (`lax.top_k`; exact), renormalised by a
   fixed-order sum over k when `norm_topk_prob`;
3. the T*k (token, expert) pairs sorted by expert (a stable sort: a permutation, exact),
   so each expert's tokens are one contiguous group; every expert matrix product runs
   over the sorted rows with each row against ITS expert's matrix (`grouped`,
   invariance/primitives.py): the grouped
   native kernel (row_gemm.cc: a row's bits depend only on its x row and its expert's W)
   or each row against its gathered expert matrix ("gather", XLA), or on a TPU its grouped
   matmul over the sorted rows ("gmm", kernels/grouped_tpu.py) - whichever the
   invariance plan chose after checking its rows bitwise at every row count (products
   named `we_gate`, `we_up`, `we_down`; calibration.py). Only the T*k routed pairs are
   computed: not every token through every expert;
4. the pairs put back in token order and combined in a FIXED order, by rank
   (out = y_1 w_1 + y_2 w_2 + ... + y_k w_k), never in the order experts happen to come;
5. Qwen2-MoE adds the shared expert, a dense SwiGLU MLP over every token (row-invariant
   products), scaled by sigmoid(x @ w_shared_gate).

Static shapes: T*k rows whatever the routing, so one program per token bucket. Padding
tokens of a step are routed like the others; they only add rows to some groups.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig
from multiserve.model.invariance.plan import ProductPlan
from multiserve.model.invariance.primitives import grouped
from multiserve.model.layers.activation import swiglu
from multiserve.model.tensor_parallel import TensorParallel, whole

EXPERT_MATRICES = ("we_gate", "we_up", "we_down")  # [E, in, out] per MoE layer
SHARED_MATRICES = ("ws_gate", "ws_up", "ws_down", "ws_router")  # qwen2_moe's shared expert


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis, left to right, one elementwise add per column: each row's
    bits depend on that row only (the axis is small: experts or top-k)."""
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total


def route(logits: jax.Array, cfg: ModelConfig, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] in `dtype`, experts [T, k] int32) from router logits [T, E], as
    transformers' Qwen MoE routers: softmax in float32, top-k, optional renormalisation."""
    logits = logits.astype(jnp.float32)
    shifted = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = shifted / fixed_order_sum(shifted)[:, None]
    top, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / fixed_order_sum(top)[:, None]
    return top.astype(dtype), experts.astype(jnp.int32)


def moe_mlp(h: jax.Array, w: dict[str, jax.Array | None], moe_index: int,
            proj: Any, cfg: ModelConfig, plans: dict[str, ProductPlan]) -> jax.Array:
    """The sparse MLP of one MoE layer over normed hidden states h [T, D] (module
    docstring). `w`: this layer's router/shared-expert layouts (for `proj`, the dense
    row-invariant product by name) and expert weights (`we_*` [E, K, N] for "gather",
    `we_*_p` the panels of every MoE layer for "native"); `moe_index`: this layer's
    ordinal among the MoE layers."""
    return moe_mlp_routed(h, w, moe_index, proj, cfg, plans)[0]


def moe_mlp_routed(h: jax.Array, w: dict[str, jax.Array | None], moe_index: int,
                   proj: Any, cfg: ModelConfig, plans: dict[str, ProductPlan],
                   tp: TensorParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """`moe_mlp` and the experts each token chose, [T, k] int32 in rank order (the
    router's top-k: the ids routing replay returns). The same computation: whether the
    caller keeps the ids changes nothing else. `tp`: the engine's devices when several
    (the expert down product reads its input whole, its output is gathered:
    model/tensor_parallel.py)."""
    t, k, e = h.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    weights, experts = route(proj(h, "router"), cfg, h.dtype)
    pair_expert = experts.reshape(-1)  # [T*k], pair p = (token p // k, rank p % k)
    order = jnp.argsort(pair_expert, stable=True)  # pairs grouped by expert
    groups = pair_expert[order]
    xs = h[order // k]
    first = moe_index * e

    def expert_product(a: jax.Array, name: str) -> jax.Array:
        return grouped(a, groups, w[name], w[f"{name}_p"], plans[name], first)

    act = whole(swiglu(expert_product(xs, "we_gate"), expert_product(xs, "we_up")), tp)
    ys = whole(expert_product(act, "we_down"), tp)
    # back to pair order (order is a permutation: scatter = exact), then by rank
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)
    out = ys[:, 0] * weights[:, 0, None]
    for j in range(1, k):
        out = out + ys[:, j] * weights[:, j, None]
    if cfg.shared_expert_intermediate_size:
        shared = proj(swiglu(proj(h, "ws_gate"), proj(h, "ws_up")), "ws_down")
        out = out + jax.nn.sigmoid(proj(h, "ws_router")) * shared
    return out, experts
