"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) as a pure forward function: the
forward of the dense families (families/dense.py). Its attention half (`attention_block`,
`layer_projection`) is every family's, the MoE decoder's too (moe_decoder.py).

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
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.lora import Adapt, layer_adapter, native_lora
from multiserve.model.invariance.plan import InvariancePlan, ProductPlan
from multiserve.model.layers.kv_pool import KVPool, write_layer
from multiserve.model.layers.norm import rms_norm
from multiserve.model.layers.rope import apply_rope, rope_inv_freq
from multiserve.model.kernels.native import PANEL
from multiserve.model.layers.activation import swiglu
from multiserve.model.tensor_parallel import TensorParallel, embed_rows, whole
from multiserve.model.invariance.primitives import (
    FUSED_GROUPS,
    LAYER_MATRICES,
    LAYOUT_SUFFIX,
    dense,
    is_compute_params,
)

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
    scanned = [t for t in token_sizes if scans(plan, t)]
    return any(plan.product(name).formulation(t).kernel == "nt"
               for name in LAYER_MATRICES for t in scanned)


def scan_needs_plain(plan: InvariancePlan, token_sizes: tuple[int, ...]) -> bool:
    """Whether the scanned decoder (the step sizes `scans` sends there) uses the plain
    product somewhere, so it reads the canonical stacked matrices (`with_transposed`'s
    `stacked_plain`)."""
    scanned = [t for t in token_sizes if scans(plan, t)]
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
           batch: ForwardBatch, cos: jax.Array, sin: jax.Array, cfg: ModelConfig, *,
           page_size: int, attn_block_size: int, plan: InvariancePlan,
           adapt: Adapt | None = None,
           tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """One pre-norm decoder layer: attention over the paged pool, then a SwiGLU MLP.
    `w` holds this layer's params (`layer_weights`): each matrix as W [in, out], W^T and
    the native panels (the whole stack, indexed by `layer`), the layouts the plan does
    not use at this step size None. `adapt`: the layer's LoRA adapters (None: none).
    `tp`: the engine's devices (None: one), for the gathers of model/tensor_parallel.py."""
    proj = layer_projection(w, layer, plan, adapt)
    x, kv = attention_block(x, kv, layer, w, proj, batch, cos, sin, cfg, page_size=page_size,
                            attn_block_size=attn_block_size, plan=plan, adapt=adapt, tp=tp)
    h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps, plan.row_sum(cfg.hidden_size))
    gate, up = project_together(h, w, layer, plan, proj, "w_gateup", adapt)
    # x + the MLP's output; down_proj reads its input whole and its output is gathered
    x = whole(proj(whole(swiglu(gate, up), tp), "w_down", residual=x), tp)
    return x, kv


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
                    cos: jax.Array, sin: jax.Array, cfg: ModelConfig, *, page_size: int,
                    attn_block_size: int, plan: InvariancePlan,
                    adapt: Adapt | None = None,
                    tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """The attention half of a pre-norm layer (every family's): x + attention(norm(x)),
    this step's K/V written into the pool. `adapt`: LoRA (the dense families only), which
    `proj` applies to o_proj itself. `tp`: as `_layer`'s (o_proj reads the heads' outputs
    whole; its output is gathered)."""
    t, hd = x.shape[0], cfg.head_dim
    norm = plan.row_sum(cfg.hidden_size)
    h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps, norm)
    q, k, v = project_together(h, w, layer, plan, proj, "wqkv", adapt)
    if cfg.attention_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q = q.reshape(t, cfg.num_heads, hd)
    k = k.reshape(t, cfg.num_kv_heads, hd)
    v = v.reshape(t, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps, plan.row_sum(hd))
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps, plan.row_sum(hd))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    kv = write_layer(kv, layer, batch.out_slots, k, v,
                     native=plan.attention.kernel == "native")
    attn = paged_attention(q, kv.k, kv.v, layer, batch, page_size=page_size,
                           block_size=attn_block_size, plan=plan.attention, tp=tp,
                           kv_heads=cfg.num_kv_heads)
    heads = whole(attn.reshape(t, cfg.num_heads * hd), tp)
    return whole(proj(heads, "wo", residual=x), tp), kv


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


def scans(plan: InvariancePlan, num_tokens: int) -> bool:
    """Whether a T-token step runs the scanned decoder: on the CPU (`plan.layer_copies`)
    above UNROLL_MAX_TOKENS, and at any size where every layer matrix uses the native
    kernel (it reads its layer of the stack in place, so a scan copies no weights: it runs
    as fast as the unrolled decoder and compiles far quicker, docs/performance.md §6). On
    an accelerator never: its unrolled decoder copies nothing either, and the compiler's
    cost analysis counts a loop body once, so only an unrolled program's count is the
    step's (the TPU compile report's floors, doctor_compile.py)."""
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
    x = embed_rows(params["embed"], batch.input_ids, tp)
    freqs = batch.positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    num_tokens = x.shape[0]
    stacked = params["stacked_layers"]
    lora = params.get("lora")  # LoRA buffers (model/layers/lora.py), absent without LoRA
    assert (lora is None) == (batch.lora_slots is None), "LoRA buffers need token slots"

    native = lora is not None and native_lora(plan, lora)

    def adapter(layer: int | jax.Array) -> Adapt | None:
        return None if lora is None else layer_adapter(lora, layer, batch.lora_slots, native)

    if not scans(plan, num_tokens):
        for index, layer in enumerate(params["layers"]):
            x, kv_pool = _layer(x, kv_pool, index,
                                layer_weights(layer, num_tokens, plan, cfg, stacked, index),
                                batch, cos, sin, cfg, page_size=page_size,
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
            x, kv = _layer(x, kv, layer, {**w, **own, **in_place}, batch, cos, sin, cfg,
                           page_size=page_size, attn_block_size=attn_block_size, plan=plan,
                           adapt=adapter(layer), tp=tp)
            return (x, kv), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv_pool), _ = jax.lax.scan(step, (x, kv_pool), (sliced, layer_ids))
    return rms_norm(x[batch.logit_rows], params["final_norm"], cfg.rms_norm_eps,
                    plan.row_sum(cfg.hidden_size)), kv_pool


def lm_head(params: Params, h: jax.Array, plan: InvariancePlan) -> jax.Array:
    """Logits f32 [R, V] of final-normed hidden states h [R, D] (row-invariant)."""
    return dense(h, params["head_w"], params["head_wt"], plan.product("head"),
                 preferred=jnp.float32, w_p=params.get("head_wp"))


def forward(params: Params, kv_pool: KVPool, batch: ForwardBatch, cfg: ModelConfig, *,
            page_size: int, attn_block_size: int,
            plan: InvariancePlan) -> tuple[jax.Array, KVPool]:
    """Run the new tokens of `batch` through the model; return (logits f32 [R, V], kv_pool)."""
    h, kv_pool = forward_hidden(params, kv_pool, batch, cfg, page_size=page_size,
                                attn_block_size=attn_block_size, plan=plan)
    return lm_head(params, h, plan).astype(jnp.float32), kv_pool
