"""The decoder of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS):
the dense families' attention (llama.attention_block: biases, windows, sinks) then, per
layer, either the sparse MLP (moe.py; GPT-OSS's: gpt_oss_moe.py, `expert_block`) or the
dense SwiGLU MLP (`mlp_only_layers` / `decoder_sparse_step`).

Canonical params (families/qwen_moe.py): "layers" (attention + norms, stacked over L),
"dense_mlp" (w_gate, w_up, w_down stacked over the dense layers), "moe" (router, the
experts we_* [Lm, E, in, out], the shared expert ws_*, GPT-OSS's router and expert biases,
stacked over the MoE layers).

Compute params (`compute_params`): the attention part as `primitives.with_transposed`
makes it for the dense families (per-layer dicts + stacks + head layouts), and for the
MLP groups the layouts the plan's kernels read: per layer `<name>` (plain) / `<name>_t`
(nt) in `mlp` (a tuple over the L layers) and the stacked panels `<name>_p` (native) in
`mlp_stacked`; the experts as the per-layer stacks we_* [E, in, out] ("gather", and the
TPU's grouped matmul "gmm", whose operand must be a whole array: XLA:TPU copies a slice
given to a custom call) and their panels we_*_p [Lm*E, P, in, 64] (native grouped kernel,
indexed by moe layer x E + expert). The per-layer expert stacks hold the experts whole:
the family keeps no canonical [Lm, E, in, out] stack beside them (qwen_moe.py
`params_to_hold`; `canonical_params` restacks them).

Where the plan keeps no per-layer copies (`layer_copies` off: an accelerator, which reads
a static slice of a stack in place) `layers` and `mlp` hold no copy (`mlp` only the
per-layer expert stacks): each layer reads static slices of the canonical stacks
(`stacked_layers`, and `mlp_stacked`'s groups, which then hold the canonical leaves and,
with "nt", the stacked transposes), so every weight is held once.

The layers are always unrolled (a Python loop): the layers are not all alike (dense and
sparse MLPs), and each reads its own arrays in place. Every product is row-invariant as
the plan says; the step's own shapes are static (T tokens, T*k routed pairs).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig
from multiserve.model.families import gpt_oss_moe, moe
from multiserve.model.families.llama import (
    attention_block,
    layer_projection,
    norm,
)
from multiserve.model.families.moe import SHARED_MATRICES
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.invariance.primitives import (
    LAYOUT_SUFFIX,
    is_compute_params,
    pack_tree,
    split_layers,
    transpose_tree,
    with_transposed,
)
from multiserve.model.kernels.native import pack_panels
from multiserve.model.layers.activation import swiglu
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import KVPool
from multiserve.model.layers.rope import rope_tables
from multiserve.model.tensor_parallel import TensorParallel, embed_rows, whole

ATTENTION_MATRICES = ("wq", "wk", "wv", "wo")
DENSE_MLP_MATRICES = ("w_gate", "w_up", "w_down")


def moe_dense_matrices(cfg: ModelConfig) -> tuple[str, ...]:
    """The dense (row-invariant `dense`) matrices of a MoE layer: router, shared expert."""
    return ("router",) + (SHARED_MATRICES if cfg.shared_expert_intermediate_size else ())


def expert_matrices(cfg: ModelConfig) -> tuple[str, ...]:
    """A MoE layer's expert matrices ([E, in, out] each), grouped products of the plan."""
    return (gpt_oss_moe.EXPERT_MATRICES if cfg.architecture == "gpt_oss"
            else moe.EXPERT_MATRICES)


def expert_block(cfg: ModelConfig) -> Any:
    """The sparse MLP of the family: (h, w, moe layer, proj, cfg, plans, tp) -> (out,
    experts [T, k])."""
    return (gpt_oss_moe.moe_mlp_routed if cfg.architecture == "gpt_oss"
            else moe.moe_mlp_routed)


@jax.jit
def _pack_experts(stacks: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[Lm, E, K, N] expert stacks -> panels [Lm*E, P, K, 64] (group = layer * E + e)."""
    return {f"{k}_p": pack_panels(v.reshape(-1, *v.shape[2:])) for k, v in stacks.items()}



def _group_layouts(group: dict[str, jax.Array], matrices: tuple[str, ...],
                   kernels: frozenset[str], layer_copies: bool
                   ) -> tuple[tuple[dict[str, jax.Array], ...], dict[str, jax.Array]]:
    """(per-layer dicts of `group`'s leaves, plain/nt layouts of its matrices; the stacked
    layouts: native panels of its matrices, and without `layer_copies` the canonical
    leaves and the transposes "nt" reads, each layer's a static slice of them)."""
    transposed = ({f"{k}_t": v for k, v in
                   transpose_tree({k: group[k] for k in matrices}).items()}
                  if "nt" in kernels else {})
    stacked = pack_tree({f"{k}_p": group[k] for k in matrices}) if "native" in kernels else {}
    if not layer_copies:
        stacked.update({**group, **transposed})
        return (), stacked
    per = {k: v for k, v in group.items() if k not in matrices or "plain" in kernels}
    per.update(transposed)
    return (split_layers(per) if per else ()), stacked


def compute_params(params: dict[str, Any], cfg: ModelConfig, kernels: frozenset[str],
                   head_kernels: frozenset[str], layer_copies: bool = True
                   ) -> dict[str, Any]:
    """The compute params (module docstring) holding the layouts of `kernels` (the plan's
    kernels of its layer matrices, `llama.plan_kernels`) and, for the head, of
    `head_kernels` (the head's own); `layer_copies`: the plan's."""
    attention = {k: v for k, v in params.items() if k not in ("dense_mlp", "moe")}
    stacks = not layer_copies  # the layers read static slices of the stacks
    out = with_transposed(attention, cfg, kernels=kernels, matrices=ATTENTION_MATRICES,
                          head_kernels=head_kernels, layer_copies=layer_copies,
                          stacked_t=stacks and "nt" in kernels,
                          stacked_plain=stacks and "plain" in kernels)
    mlp: list[dict[str, jax.Array]] = [{} for _ in range(cfg.num_layers)]
    mlp_stacked: dict[str, Any] = {}
    if cfg.dense_mlp_layers:
        per, stacked = _group_layouts(params["dense_mlp"], DENSE_MLP_MATRICES, kernels,
                                      layer_copies)
        for j, i in enumerate(cfg.dense_mlp_layers):
            mlp[i] = dict(per[j]) if per else {}
        mlp_stacked["dense_mlp"] = stacked
    if cfg.moe_layers:
        group = params["moe"]
        dense_names = moe_dense_matrices(cfg)
        experts = {k: group[k] for k in expert_matrices(cfg)}
        others = {k: v for k, v in group.items() if k not in dense_names and k not in experts}
        per, stacked = _group_layouts({**{k: group[k] for k in dense_names}, **others},
                                      dense_names, kernels, layer_copies)
        # the expert stacks [E, K, N] "gather" and "gmm" read, per layer in any plan
        per_experts = split_layers(experts) if {"gather", "gmm"} & set(kernels) else ()
        for j, i in enumerate(cfg.moe_layers):
            mlp[i] = {**(per[j] if per else {}), **(per_experts[j] if per_experts else {})}
        if "native" in kernels:
            stacked.update(_pack_experts(experts))
        mlp_stacked["moe"] = stacked
    out["mlp"] = tuple(mlp)
    out["mlp_stacked"] = mlp_stacked
    return out


def _layer_leaf(per_layer: dict[str, jax.Array], stacked: dict[str, jax.Array], name: str,
                index: int) -> jax.Array:
    """A layer's leaf `name`: its per-layer copy, or (no per-layer copies) the static slice
    `index` of its stack, which the compiler reads in place."""
    if name in per_layer:
        return per_layer[name]
    assert name in stacked, f"the plan's {name} layout is missing from the compute params"
    return stacked[name][index]


def _layouts(matrices: tuple[str, ...]) -> set[str]:
    """The names of every layout of `matrices` (`<name>`, `<name>_t`, `<name>_p`)."""
    return {m + sfx for m in matrices for sfx in LAYOUT_SUFFIX.values()}


def _leaf_names(stacked: dict[str, jax.Array], matrices: tuple[str, ...]
                ) -> tuple[str, ...]:
    """The stacked leaves of a group that are not a layout of one of its `matrices`
    (norms, biases, sinks): each layer reads its own slice of them."""
    layouts = _layouts(matrices)
    return tuple(k for k in stacked if k not in layouts and not k.endswith("_p"))


def _select(per_layer: dict[str, jax.Array], stacked: dict[str, jax.Array],
            matrices: tuple[str, ...], num_rows: int, plan: InvariancePlan, index: int,
            leaves: tuple[str, ...] = ()) -> dict[str, jax.Array | None]:
    """One layer's weights for a step: of each matrix only the layout the plan's kernel
    uses at `num_rows` rows (`<name>`/`<name>_t` of the layer, `<name>_p` the whole stack,
    which the native kernel indexes itself), the others None; the other leaves of the
    layer, and the stacked `leaves` (without per-layer copies: the layer is `index` of the
    stacks)."""
    layouts = _layouts(matrices)
    out: dict[str, jax.Array | None] = {k: v for k, v in per_layer.items()
                                        if k not in layouts}
    for name in leaves:
        out[name] = _layer_leaf(per_layer, stacked, name, index)
    for m in matrices:
        kernel = plan.product(m).formulation(num_rows).kernel
        used = m + ("" if kernel == "gather" else LAYOUT_SUFFIX[kernel])
        value = (stacked[used] if kernel == "native"
                 else _layer_leaf(per_layer, stacked, used, index))
        for sfx in LAYOUT_SUFFIX.values():
            out[m + sfx] = value if m + sfx == used else None
    return out


def forward_hidden(params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                   cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                   plan: InvariancePlan,
                   tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """As llama.forward_hidden, for a MoE family: (final-normed hidden states of the
    `batch.logit_rows` rows [R, D], new kv_pool)."""
    h, kv_pool, _ = _decoder(params, kv_pool, batch, cfg, page_size=page_size,
                             attn_block_size=attn_block_size, plan=plan, tp=tp)
    return h, kv_pool


def forward_hidden_routed(params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                          cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                          plan: InvariancePlan, tp: TensorParallel | None = None
                          ) -> tuple[jax.Array, KVPool, jax.Array]:
    """`forward_hidden` and the routed experts of every token row of the batch (padding
    rows included): [T, Lm, k] int32, MoE layer j = the j-th of `cfg.moe_layers`, each
    row's k ids in the router's rank order. The hidden states and K/V are those of
    `forward_hidden` bit for bit (the same operations; only the ids are kept)."""
    h, kv_pool, routed = _decoder(params, kv_pool, batch, cfg, page_size=page_size,
                                  attn_block_size=attn_block_size, plan=plan, tp=tp)
    t, k = batch.input_ids.shape[0], max(cfg.num_experts_per_tok, 1)
    experts = jnp.stack(routed, axis=1) if routed else jnp.zeros((t, 0, k), jnp.int32)
    return h, kv_pool, experts


def _decoder(params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
             cfg: ModelConfig, *, page_size: int, attn_block_size: int,
             plan: InvariancePlan, tp: TensorParallel | None
             ) -> tuple[jax.Array, KVPool, list[jax.Array]]:
    """(final-normed hidden states of the logit rows, new kv_pool, the experts [T, k] of
    each MoE layer in layer order). A caller that drops the list traces no operation for
    it: the ids are the routing's own values. `tp`: as llama.forward_hidden's."""
    assert is_compute_params(params) and "mlp" in params, "needs moe_decoder.compute_params"
    x = embed_rows(params["embed"], batch.input_ids, tp)
    rope = rope_tables(cfg, batch.positions)
    t = x.shape[0]
    pairs = t * max(cfg.num_experts_per_tok, 1)
    dense_index = {i: j for j, i in enumerate(cfg.dense_mlp_layers)}
    moe_index = {i: j for j, i in enumerate(cfg.moe_layers)}
    matrices = expert_matrices(cfg)
    expert_plans = {m: plan.product(m) for m in matrices} if cfg.moe_layers else {}
    block = expert_block(cfg)
    attention_leaves = _leaf_names(params["stacked_layers"], ATTENTION_MATRICES)
    moe_stacked = params["mlp_stacked"].get("moe", {})
    moe_leaves = _leaf_names(moe_stacked, moe_dense_matrices(cfg) + matrices)
    routed: list[jax.Array] = []  # [T, k] per MoE layer, in layer order
    for i, layer in enumerate(params["layers"]):
        w = _select(layer, params["stacked_layers"], ATTENTION_MATRICES, t, plan, i,
                    attention_leaves)
        x, kv_pool = attention_block(x, kv_pool, i, w, layer_projection(w, i, plan), batch,
                                     rope, cfg, page_size=page_size,
                                     attn_block_size=attn_block_size, plan=plan, tp=tp)
        h = norm(x, w["mlp_norm"], cfg, plan)
        if i in moe_index:
            j = moe_index[i]
            mw = _select(params["mlp"][i], moe_stacked, moe_dense_matrices(cfg), t, plan, j,
                         moe_leaves)
            for m in matrices:
                native = expert_plans[m].formulation(pairs).kernel == "native"
                mw[m] = None if native else params["mlp"][i][m]
                mw[f"{m}_p"] = moe_stacked[f"{m}_p"] if native else None
            y, chosen = block(h, mw, j, layer_projection(mw, j, plan), cfg, expert_plans, tp)
            x = x + y
            routed.append(chosen)
        else:
            j = dense_index[i]
            mw = _select(params["mlp"][i], params["mlp_stacked"]["dense_mlp"],
                         DENSE_MLP_MATRICES, t, plan, j)
            proj = layer_projection(mw, j, plan)
            act = whole(swiglu(proj(h, "w_gate"), proj(h, "w_up")), tp)
            x = whole(proj(act, "w_down", residual=x), tp)
    return norm(x[batch.logit_rows], params["final_norm"], cfg, plan), kv_pool, routed
