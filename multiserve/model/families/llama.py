"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral, Gemma 2 / 3) as a pure
forward function: the forward of the dense families (families/dense.py, mistral.py,
gemma.py). Its attention half (`attention_block`, `layer_projection`) is every family's,
the MoE decoder's too (moe_decoder.py).

What differs between the families is the config's, read here (config.ModelConfig): q/k/v
biases, q/k norms, each layer's attention terms (sliding window, scale, soft cap:
layers/attention_terms.py) and rope base (layers/rope.py), Gemma's norms (`norm_plus_one`:
(1 + w) in float32; `sandwich_norms`: each block's output normed before its residual
add), its scaled embeddings, the MLP's activation (`hidden_act`) and the final soft cap.

`forward(params, kv_pool, batch, cfg, page_size=, attn_block_size=)` -> (logits f32 [R, V],
new kv_pool), also available in two halves: `forward_hidden` (decoder, final norm, the
logits rows' hidden states) and `lm_head`. No globals, no implicit context: jit with
cfg/page_size/attn_block_size static and kv_pool donated; the pool is updated in place.

Params: the compute params, `primitives.with_transposed(params, cfg)`: the plain-dict pytree of
`param_layout` (layers stacked over L, matrices [in, out]) plus a transposed copy of every
matrix, so that every product is row-invariant (see invariance/primitives.py), split into one dict
per layer. Compute is in the params dtype, attention softmax/accumulation in fp32, logits in
fp32. The layers are unrolled over that tuple (see `forward_hidden`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.plan import InvariancePlan, ProductPlan
from multiserve.model.invariance.primitives import (
    FUSED_GROUPS,
    LAYER_MATRICES,
    LAYOUT_SUFFIX,
    dense,
    is_compute_params,
)
from multiserve.model.kernels.native import PANEL
from multiserve.model.layers.activation import gated
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_terms import layer_terms
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import KVPool, write_layer
from multiserve.model.layers.lora import Adapt, layer_adapter, native_lora
from multiserve.model.layers.norm import rms_norm
from multiserve.model.layers.rope import RopeTables, apply_rope, rope_tables
from multiserve.model.tensor_parallel import TensorParallel, embed_rows, whole

Params = dict[str, Any]
# Steps of up to this many tokens run the unrolled decoder (see `forward_hidden`) where some
# layer matrix uses an XLA product; larger ones scan. Unrolling saves a scan's per-step
# weight copies, which weigh most at small steps, for a compile several times longer
# (docs/performance.md §6).
UNROLL_MAX_TOKENS = 64


def scan_needs_transposes(plan: InvariancePlan, cfg: ModelConfig,
                          token_sizes: tuple[int, ...]) -> bool:
    """Whether the scanned decoder (the step sizes `scans` sends there) uses the NT product
    somewhere, so the stacked transposes must be kept (`with_transposed`)."""
    scanned = [t for t in token_sizes if scans(plan, t, cfg)]
    return any(plan.product(name).formulation(t).kernel == "nt"
               for name in LAYER_MATRICES for t in scanned)


def scan_needs_plain(plan: InvariancePlan, token_sizes: tuple[int, ...],
                     cfg: ModelConfig | None = None) -> bool:
    """Whether the scanned decoder (the step sizes `scans` sends there) uses the plain
    product somewhere, so it reads the canonical stacked matrices (`with_transposed`'s
    `stacked_plain`)."""
    scanned = [t for t in token_sizes if scans(plan, t, cfg)]
    return any(plan.product(name).formulation(t).kernel == "plain"
               for name in LAYER_MATRICES for t in scanned)


def plan_kernels(plan: InvariancePlan, names: tuple[str, ...] | None = None
                 ) -> frozenset[str]:
    """The product kernels the plan uses for the products `names` (None: anywhere): the
    weight layouts the compute params must hold (`primitives.with_transposed(...,
    kernels=, head_kernels=)`)."""
    return frozenset(f.kernel for p in plan.products for _, f in p.by_rows
                     if names is None or p.name in names)


def fused_groups(plan: InvariancePlan, token_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The FUSED_GROUPS whose members the plan runs with the same native formulation at
    every step size (`token_sizes`, the forward's buckets): those run as one product of
    their panels side by side (`primitives.with_transposed(fused=)`), bitwise the same."""
    def alike(members: tuple[str, ...], t: int) -> bool:
        forms = {plan.product(m).formulation(t) for m in members}
        return len(forms) == 1 and next(iter(forms)).kernel == "native"

    return tuple(g for g, members in FUSED_GROUPS.items()
                 if token_sizes and all(alike(members, t) for t in token_sizes))


def project_together(h: jax.Array, w: dict[str, jax.Array | None],
                     layer: int | jax.Array, plan: InvariancePlan, proj: Any,
                     group: str, adapt: Adapt | None = None) -> tuple[jax.Array, ...]:
    """h times each member of `group` (FUSED_GROUPS): one native product of the group's
    panels `<group>_p` where `w` holds them (then sliced per member: each member's columns
    start at a panel boundary), else one product per member through `proj`. `adapt`:
    each member's LoRA (model/layers/lora.py): on the whole product before it is sliced
    (every member at its first column, one native call, no copy of a member's columns),
    or applied by `proj` to each member's own product."""
    members = FUSED_GROUPS[group]
    panels = w.get(f"{group}_p")
    if panels is None:
        return tuple(proj(h, m) for m in members)
    first = plan.product(members[0])
    widths = [plan.product(m).n for m in members]
    starts = np.cumsum([0] + [-(-n // PANEL) * PANEL for n in widths])
    together = ProductPlan(group, first.k, int(starts[-1]), first.by_rows)
    offsets = tuple(int(a) for a in starts[:-1])
    # with LoRA, in place in the whole product, each member at its columns: at one token
    # inside the product's own call (`LayerLora.product`), else a call after it
    out = None if adapt is None else adapt.product(h, tuple(members), panels, together,
                                                   offsets)
    if out is None:
        out = dense(h, None, None, together, w_p=panels, layer=layer)
        if adapt is not None:
            out = adapt(h, tuple(members), out, offsets)
    return tuple(out[:, int(a):int(a) + n] for a, n in zip(starts[:-1], widths, strict=True))


def _layer(x: jax.Array, kv: KVPool, layer: int | jax.Array, w: dict[str, jax.Array | None],
           batch: ForwardBatch, rope: RopeTables, cfg: ModelConfig, *,
           page_size: int, attn_block_size: int, plan: InvariancePlan,
           adapt: Adapt | None = None,
           tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """One pre-norm decoder layer: attention over the paged pool, then a gated MLP.
    `w` holds this layer's params (`layer_weights`): each matrix as W [in, out], W^T and
    the native panels (the whole stack, indexed by `layer`), the layouts the plan does
    not use at this step size None. `adapt`: the layer's LoRA adapters (None: none).
    `tp`: the engine's devices (None: one), for the gathers of model/tensor_parallel.py."""
    proj = layer_projection(w, layer, plan, adapt)
    x, kv = attention_block(x, kv, layer, w, proj, batch, rope, cfg, page_size=page_size,
                            attn_block_size=attn_block_size, plan=plan, adapt=adapt, tp=tp)
    h = norm(x, w["mlp_norm"], cfg, plan)
    gate, up = project_together(h, w, layer, plan, proj, "w_gateup", adapt)
    act = whole(gated(gate, up, cfg.hidden_act), tp)
    # x + the MLP's output; down_proj reads its input whole and its output is gathered
    return residual_add(x, act, "w_down", "post_mlp_norm", w, proj, cfg, plan, tp), kv


def norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig, plan: InvariancePlan
         ) -> jax.Array:
    """The family's RMSNorm of x over its last axis (Gemma's `norm_plus_one` form or
    Llama's), its row sums as the plan says for that width."""
    return rms_norm(x, weight, cfg.rms_norm_eps, plan.row_sum(x.shape[-1]),
                    plus_one=cfg.norm_plus_one, weight_f32=cfg.norm_weight_f32)


def residual_add(x: jax.Array, h: jax.Array, matrix: str, post_norm: str,
                 w: dict[str, jax.Array | None], proj: Projection, cfg: ModelConfig,
                 plan: InvariancePlan, tp: TensorParallel | None) -> jax.Array:
    """x + h @ W[matrix] (the product reads h whole; its output is gathered): the add in
    the product (`proj`'s residual); with `o_proj_bias`, o_proj's output plus its bias
    `w["bo"]`, then the add; with `sandwich_norms`, the add after the output's own norm
    `w[post_norm]`."""
    if matrix == "wo" and cfg.o_proj_bias:  # x + (h @ W + b)
        return x + (whole(proj(h, matrix), tp) + w["bo"])
    if not cfg.sandwich_norms:
        return whole(proj(h, matrix, residual=x), tp)
    y = whole(proj(h, matrix), tp)
    return x + norm(y, w[post_norm], cfg, plan)


# (h [M, K], matrix name, residual [M, N] or None) -> residual + h @ W, row-invariant
# (`layer_projection`)
Projection = Any


def layer_projection(w: dict[str, jax.Array | None], layer: int | jax.Array,
                     plan: InvariancePlan, adapt: Adapt | None = None) -> Projection:
    """The row-invariant product with one of this layer's matrices, by name: the plan's
    layout from `w` (`<name>`, `<name>_t`, or the stacked panels `<name>_p` indexed by
    `layer`), with each adapter token's LoRA delta added (`adapt`; None: no LoRA)."""

    def proj(h: jax.Array, name: str, residual: jax.Array | None = None) -> jax.Array:
        panels = w[f"{name}_p"]  # the whole stack: the native kernel indexes the layer
        if adapt is not None:  # one token: the delta in the product's own call
            fused = adapt.product(h, (name,), panels, plan.product(name), (0,), residual)
            if fused is not None:
                return fused
        y = dense(h, w[name], w[f"{name}_t"], plan.product(name), w_p=panels,
                  layer=None if panels is None else layer, residual=residual)
        return y if adapt is None else adapt(h, (name,), y, (0,))

    return proj


def attention_block(x: jax.Array, kv: KVPool, layer: int | jax.Array,
                    w: dict[str, jax.Array | None], proj: Projection, batch: ForwardBatch,
                    rope: RopeTables, cfg: ModelConfig, *, page_size: int,
                    attn_block_size: int, plan: InvariancePlan,
                    adapt: Adapt | None = None,
                    tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """The attention half of a pre-norm layer (every family's): x + attention(norm(x)),
    this step's K/V written into the pool. `adapt`: LoRA (the dense families only), which
    `proj` applies to o_proj itself. `tp`: as `_layer`'s (o_proj reads the heads' outputs
    whole; its output is gathered)."""
    t, hd = x.shape[0], cfg.head_dim
    h = norm(x, w["attn_norm"], cfg, plan)
    q, k, v = project_together(h, w, layer, plan, proj, "wqkv", adapt)
    if cfg.attention_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q = q.reshape(t, cfg.num_heads, hd)
    k = k.reshape(t, cfg.num_kv_heads, hd)
    v = v.reshape(t, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q, k = norm(q, w["q_norm"], cfg, plan), norm(k, w["k_norm"], cfg, plan)
    cos, sin = rope.for_layer(layer)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    kv = write_layer(kv, layer, batch.out_slots, k, v,
                     native=plan.attention.kernel == "native")
    attn = paged_attention(q, kv.k, kv.v, layer, batch, page_size=page_size,
                           block_size=attn_block_size, plan=plan.attention,
                           terms=layer_terms(cfg, layer, w.get("sinks")), tp=tp,
                           kv_heads=cfg.num_kv_heads)
    heads = whole(attn.reshape(t, cfg.num_heads * hd), tp)
    return residual_add(x, heads, "wo", "post_attn_norm", w, proj, cfg, plan, tp), kv


def layer_weights(layer: dict[str, jax.Array], num_tokens: int, plan: InvariancePlan,
                   cfg: ModelConfig, stacked: dict[str, jax.Array],
                   index: int | None = None) -> dict[str, jax.Array | None]:
    """One layer's params for a T-token step: of each matrix only the layout the plan's
    kernel uses at this T (`<name>` or `<name>_t` from `layer`, or where the plan keeps no
    per-layer copies (`layer_copies` off) the static slice `index` of its stack; the
    native kernel's panels `<name>_p` are the whole stack from `stacked`: the kernel
    indexes the layer); the others are None, so the program does not take them as
    inputs."""
    def matrix(k: str) -> bool:
        return any(k == base + sfx for base in LAYER_MATRICES for sfx in LAYOUT_SUFFIX.values())

    out: dict[str, jax.Array | None] = {k: v for k, v in layer.items() if not matrix(k)}
    if index is not None:  # no per-layer copies: the norms and biases from their stacks
        out.update({k: v[index] for k, v in stacked.items()
                    if not matrix(k) and k not in out and not k.endswith("_p")})
    for group in FUSED_GROUPS:
        out[f"{group}_p"] = stacked.get(f"{group}_p")  # whole stack; None: not fused
    together = {m for g, ms in FUSED_GROUPS.items() if out[f"{g}_p"] is not None for m in ms}
    for base in LAYER_MATRICES:
        if base in together:  # computed with its group's panels (project_together)
            for sfx in LAYOUT_SUFFIX.values():
                out[base + sfx] = None
            continue
        kernel = plan.product(base).formulation(num_tokens).kernel
        used = base + LAYOUT_SUFFIX[kernel]
        source = stacked if kernel == "native" else layer
        if used in source:
            value = source[used]
        else:
            assert index is not None and used in stacked, (
                f"the plan's {used} layout is missing from the compute params "
                "(with_transposed(kernels=plan_kernels(plan, LAYER_MATRICES)); the scanned "
                "decoder's NT product, or no per-layer copies, also needs stacked_t=True)")
            value = stacked[used][index]  # a static slice: read in place (layer_copies)
        for sfx in LAYOUT_SUFFIX.values():
            out[base + sfx] = value if base + sfx == used else None
    return out


def scans(plan: InvariancePlan, num_tokens: int, cfg: ModelConfig | None = None) -> bool:
    """Whether a T-token step runs the scanned decoder: on the CPU (`plan.layer_copies`)
    above UNROLL_MAX_TOKENS, and at any size where every layer matrix uses the native
    kernel (it reads its layer of the stack in place, so a scan copies no weights: it runs
    as fast as the unrolled decoder and compiles far quicker, docs/performance.md §6). On
    an accelerator not otherwise: its unrolled decoder copies nothing either, and the
    compiler's cost analysis counts a loop body once, so only an unrolled program's count
    is the step's (the TPU compile report's floors, doctor/compile.py). A model with
    sandwich norms (Gemma) scans at every size on every platform: its post-block norms are
    added to the residual stream, and XLA:CPU contracts such a norm's last multiply with
    the add into one FMA where the two share a fusion; an unrolled program fuses across
    layers otherwise than the scan's body, so the two rounded a row differently, where
    every scanned program gives the same bits (docs/determinism.md §3;
    tests/model/test_families.py)."""
    if cfg is not None and cfg.sandwich_norms:
        return True
    if not plan.layer_copies:
        return False
    return num_tokens > UNROLL_MAX_TOKENS or all(
        plan.product(base).formulation(num_tokens).kernel == "native"
        for base in LAYER_MATRICES)


def forward_hidden(params: Params, kv_pool: KVPool, batch: ForwardBatch, cfg: ModelConfig, *,
                   page_size: int, attn_block_size: int, plan: InvariancePlan,
                   tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """Run the new tokens of `batch` through the decoder; return (the final-normed hidden
    states of the `batch.logit_rows` rows [R, D], new kv_pool). `params` are compute params
    (`primitives.with_transposed`); `plan` says how each primitive computes this step's
    sizes (invariance/plan.py); `tp`: the engine's devices when it has several (the
    forward then sums no float across devices: model/tensor_parallel.py).

    Steps that `scans` keeps out of the scan (<= UNROLL_MAX_TOKENS tokens with some XLA
    product) unroll the layers (a Python loop over the per-layer tuple): each layer's
    matmuls read its own arrays in place, where a scan slices (copies) every layer's
    weights out of the stacked arrays at every step, a large share of a one-token step.
    The price is compile time (several times a scanned program's, docs/performance.md §6),
    paid at warm-up. Every other step scans the stacked layers (the canonical stacked
    matrices where the plan uses the plain product at a scanned size, `scan_needs_plain`;
    their stacked transposes where it uses the NT product, `scan_needs_transposes`; the
    norms and biases); the native kernel's panels are passed whole (it indexes the
    layer), so an all-native step copies nothing."""
    assert is_compute_params(params), "forward needs primitives.with_transposed(params, cfg)"
    x = embed(params["embed"], batch.input_ids, cfg, tp)
    rope = rope_tables(cfg, batch.positions)
    num_tokens = x.shape[0]
    stacked = params["stacked_layers"]
    lora = params.get("lora")  # LoRA buffers (model/layers/lora.py), absent without LoRA
    assert (lora is None) == (batch.lora_slots is None), "LoRA buffers need token slots"

    native = lora is not None and native_lora(plan, lora)

    def adapter(layer: int | jax.Array) -> Adapt | None:
        return None if lora is None else layer_adapter(lora, layer, batch.lora_slots, native)

    if not scans(plan, num_tokens, cfg):
        for index, layer in enumerate(params["layers"]):
            x, kv_pool = _layer(x, kv_pool, index,
                                layer_weights(layer, num_tokens, plan, cfg, stacked, index),
                                batch, rope, cfg, page_size=page_size,
                                attn_block_size=attn_block_size, plan=plan,
                                adapt=adapter(index), tp=tp)
    else:
        weights = layer_weights(stacked, num_tokens, plan, cfg, stacked)
        # the native panels stay whole (the kernel indexes the layer); the rest is scanned
        in_place = {k: v for k, v in weights.items() if k.endswith("_p") and v is not None}
        # bfloat16 stacks are not scanned: XLA:CPU widens a bfloat16 dynamic slice to
        # float32 and hoists the widening of the WHOLE stack out of the loop (a float32 copy
        # of every such matrix written at every step). A switch over the layer's static
        # slices copies only that layer, the same bytes.
        switched = {k: v for k, v in weights.items()
                    if k not in in_place and v is not None and v.dtype == jnp.bfloat16
                    and plan.layer_copies}  # XLA:CPU's; an accelerator slices in place
        sliced = {k: v for k, v in weights.items()
                  if k not in in_place and k not in switched}
        by_layer = [lambda i=i: {k: v[i] for k, v in switched.items()}
                    for i in range(cfg.num_layers)]

        def step(carry: tuple[jax.Array, KVPool], xs: Any) -> tuple[Any, None]:
            x, kv = carry
            w, layer = xs
            own = jax.lax.switch(layer, by_layer) if switched else {}
            x, kv = _layer(x, kv, layer, {**w, **own, **in_place}, batch, rope, cfg,
                           page_size=page_size, attn_block_size=attn_block_size, plan=plan,
                           adapt=adapter(layer), tp=tp)
            return (x, kv), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv_pool), _ = jax.lax.scan(step, (x, kv_pool), (sliced, layer_ids))
    return norm(x[batch.logit_rows], params["final_norm"], cfg, plan), kv_pool


def embed(table: jax.Array, ids: jax.Array, cfg: ModelConfig,
          tp: TensorParallel | None) -> jax.Array:
    """The rows of `table` for `ids` (model/tensor_parallel.py `embed_rows`), times
    sqrt(hidden_size) in their dtype where the family scales its embeddings (Gemma: the
    factor rounded to the weights' dtype first, as transformers does)."""
    x = embed_rows(table, ids, tp)
    if not cfg.scale_embeddings:
        return x
    return x * jnp.asarray(cfg.hidden_size ** 0.5, jnp.float32).astype(x.dtype)


def lm_head(params: Params, h: jax.Array, plan: InvariancePlan,
            cfg: ModelConfig | None = None) -> jax.Array:
    """Logits f32 [R, V] of final-normed hidden states h [R, D] (row-invariant), soft-capped
    as cfg's `final_logit_softcapping` says (cap * tanh(logits / cap), float32)."""
    logits = dense(h, params["head_w"], params["head_wt"], plan.product("head"),
                   preferred=jnp.float32, w_p=params.get("head_wp"))
    cap = 0.0 if cfg is None else cfg.final_logit_softcapping
    return logits if cap <= 0 else jnp.tanh(logits / cap) * cap
