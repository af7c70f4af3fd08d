"""The dense decoder families: Llama (incl. SmolLM2, llama3 rope scaling), Qwen2 (q/k/v
biases) and Qwen3 (q/k RMSNorm), behind the model interface (families/base.py).

Params layout (plain dict; "layers" leaves stacked over L layers; matmul weights [in, out]):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when cfg.tie_word_embeddings)
  layers: attn_norm [L, D]; wq [L, D, H*hd]; wk, wv [L, D, KV*hd]; wo [L, H*hd, D];
          bq [L, H*hd], bk, bv [L, KV*hd]   (only when cfg.attention_bias)
          q_norm, k_norm [L, hd]            (only when cfg.qk_norm)
          post_attn_norm [L, D]             (only when cfg.sandwich_norms)
          mlp_norm [L, D]; w_gate, w_up [L, D, F]; w_down [L, F, D]
          post_mlp_norm [L, D]              (only when cfg.sandwich_norms)
The forward is model/families/llama.py. Shared with the MoE families: the attention half of the
layout and its HF names (`attention_layer_shapes`, `ATTENTION_HF_NAMES`), the top-level
tensors (`top_level`), the attention sharding rules (`attention_specs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.base import HfTensorSpec, ProductShape
from multiserve.model.param_tree import get_leaf
from multiserve.model.tp_splits import tp_splits

if TYPE_CHECKING:  # the step's types (jax): for the checker only, this module stays jax-free
    import jax
    from jax.sharding import Mesh

    from multiserve.model.invariance.plan import InvariancePlan
    from multiserve.model.layers.forward_batch import ForwardBatch
    from multiserve.model.layers.kv_pool import KVPool
    from multiserve.model.tensor_parallel import TensorParallel

# (our layer key, HF suffix under model.layers.{i}., transposed)
ATTENTION_HF_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("attn_norm", "input_layernorm.weight", False),
    ("wq", "self_attn.q_proj.weight", True),
    ("wk", "self_attn.k_proj.weight", True),
    ("wv", "self_attn.v_proj.weight", True),
    ("wo", "self_attn.o_proj.weight", True),
    ("bq", "self_attn.q_proj.bias", False),
    ("bk", "self_attn.k_proj.bias", False),
    ("bv", "self_attn.v_proj.bias", False),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("mlp_norm", "post_attention_layernorm.weight", False),
)
# with sandwich norms (Gemma) the MLP's input norm is the pre-feed-forward one, and
# post_attention_layernorm norms the attention's output
SANDWICH_HF_NAMES: dict[str, str] = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
MLP_HF_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("w_gate", "mlp.gate_proj.weight", True),
    ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True),
)
CONFIG_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                 "num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                 "rope_theta", "rms_norm_eps")


def attention_hf_names(cfg: ModelConfig) -> tuple[tuple[str, str, bool], ...]:
    """ATTENTION_HF_NAMES, with sandwich norms (Gemma) their names (SANDWICH_HF_NAMES)."""
    if not cfg.sandwich_norms:
        return ATTENTION_HF_NAMES
    names = [(k, SANDWICH_HF_NAMES.get(k, suffix), t) for k, suffix, t in ATTENTION_HF_NAMES]
    return (*names, ("post_attn_norm", SANDWICH_HF_NAMES["post_attn_norm"], False),
            ("post_mlp_norm", SANDWICH_HF_NAMES["post_mlp_norm"], False))


def attention_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention params and both norms (no leading L axis), in a fixed order."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,), "wq": (d, qd), "wk": (d, kvd), "wv": (d, kvd), "wo": (qd, d)}
    if cfg.attention_bias:
        shapes.update(bq=(qd,), bk=(kvd,), bv=(kvd,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    shapes["mlp_norm"] = (d,)
    return shapes


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one dense layer's params (without the leading L axis), in a fixed order."""
    return {**attention_layer_shapes(cfg), **mlp_shapes(cfg)}


def _layer_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The layer matrices of `layer_param_shapes` ([in, out] a layer; its norms are [D])."""
    return {k: s for k, s in layer_param_shapes(cfg).items() if len(s) == 2}


def top_level(cfg: ModelConfig) -> dict[str, Any]:
    """embed, final_norm and (untied) lm_head shapes."""
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, cfg.hidden_size),
                              "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def layer_specs(names: tuple[tuple[str, str, bool], ...], shapes: dict[str, tuple[int, ...]],
                layers: tuple[int, ...], group: str = "layers") -> dict[str, HfTensorSpec]:
    """HF specs of per-layer tensors: model layer `layers[j]` is index j of its stack."""
    specs: dict[str, HfTensorSpec] = {}
    for j, i in enumerate(layers):
        for key, suffix, transposed in names:
            if key in shapes:
                shape = shapes[key][::-1] if transposed else shapes[key]
                specs[f"model.layers.{i}.{suffix}"] = HfTensorSpec(key, j, shape, transposed,
                                                                   group)
    return specs


def top_level_specs(cfg: ModelConfig) -> tuple[dict[str, HfTensorSpec], dict[str, HfTensorSpec]]:
    """(the specs before the layers, the specs after them), HF's order."""
    d, v = cfg.hidden_size, cfg.vocab_size
    head = {"model.norm.weight": HfTensorSpec("final_norm", None, (d,), False)}
    if not cfg.tie_word_embeddings:
        head["lm_head.weight"] = HfTensorSpec("lm_head", None, (v, d), True)
    return {"model.embed_tokens.weight": HfTensorSpec("embed", None, (v, d), False)}, head


def attention_specs(cfg: ModelConfig, n: int) -> dict[str, Any]:
    """PartitionSpecs of the attention leaves stacked over L (heads split when both head
    counts divide by n, o_proj's output when the hidden size does) and the top-level
    leaves (vocabulary split when it divides)."""
    from jax.sharding import PartitionSpec as P

    split = tp_splits(cfg, n)
    t = "tensor"
    attn = split["attention"]
    layers = {
        "wq": P(None, None, t) if attn else P(), "wk": P(None, None, t) if attn else P(),
        "wv": P(None, None, t) if attn else P(),
        "bq": P(None, t) if attn else P(), "bk": P(None, t) if attn else P(),
        "bv": P(None, t) if attn else P(),
        # on its output dimension like every matrix (model/tensor_parallel.py): its
        # input, the heads' outputs, is gathered whole first
        "wo": P(None, None, t) if split["hidden"] else P()}
    top = {"embed": P(t, None) if split["vocab"] else P(), "final_norm": P(),
           "lm_head": P(None, t) if split["vocab"] else P()}
    return {"layers": layers, **top}


def attention_products(cfg: ModelConfig, tp: int) -> list[ProductShape]:
    """The attention projections and the head, with the sides a TP group splits."""
    split = tp_splits(cfg, tp)
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    a = "out" if split["attention"] else ""
    return [ProductShape("wq", d, q, a), ProductShape("wk", d, kv, a),
            ProductShape("wv", d, kv, a),
            ProductShape("wo", q, d, "out" if split["hidden"] else ""),
            ProductShape("head", d, cfg.vocab_size, "out" if split["vocab"] else "", "rows")]


def dense_mlp_products(cfg: ModelConfig, tp: int) -> list[ProductShape]:
    split = tp_splits(cfg, tp)
    d, f = cfg.hidden_size, cfg.intermediate_size
    return [ProductShape("w_gate", d, f, "out" if split["mlp"] else ""),
            ProductShape("w_up", d, f, "out" if split["mlp"] else ""),
            ProductShape("w_down", f, d, "out" if split["hidden"] else "")]


class DenseFamily:
    """Llama / Qwen2 / Qwen3 (see module docstring)."""

    name = "dense"
    architectures = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                     "Qwen3ForCausalLM": "qwen3"}
    model_types: tuple[str, ...] = ("llama", "qwen2", "qwen3")
    config_fields: tuple[str, ...] = CONFIG_FIELDS

    # ---- config ----------------------------------------------------------------------
    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        if raw.get("mlp_bias") or (arch == "llama" and raw.get("attention_bias")):
            raise ModelLoadError(f"{source}: llama with mlp_bias/attention_bias is not "
                                 "supported")
        return ModelConfig(architecture=arch, attention_bias=arch == "qwen2",
                           qk_norm=arch == "qwen3", **common)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.attention_bias}

    def unpack_hf_tensors(self, named: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The checkpoint's tensors as stored (nothing to unpack)."""
        return named

    # ---- layout ----------------------------------------------------------------------
    def param_shapes(self, cfg: ModelConfig) -> dict[str, Any]:
        top = top_level(cfg)
        shapes: dict[str, Any] = {
            "embed": top["embed"],
            "layers": {k: (cfg.num_layers, *s) for k, s in layer_param_shapes(cfg).items()},
            "final_norm": top["final_norm"]}
        if "lm_head" in top:
            shapes["lm_head"] = top["lm_head"]
        return shapes

    def hf_tensor_specs(self, cfg: ModelConfig) -> dict[str, HfTensorSpec]:
        before, after = top_level_specs(cfg)
        layers = layer_specs(attention_hf_names(cfg) + MLP_HF_NAMES, layer_param_shapes(cfg),
                             tuple(range(cfg.num_layers)))
        return {**before, **layers, **after}

    # ---- sharding --------------------------------------------------------------------
    def param_specs(self, cfg: ModelConfig, mesh: Mesh, moe_sharding: str) -> dict[str, Any]:
        from jax.sharding import PartitionSpec as P

        n = mesh.shape["tensor"]
        base = attention_specs(cfg, n)
        t = "tensor"
        split = tp_splits(cfg, n)
        mlp = split["mlp"]
        base["layers"].update({"w_gate": P(None, None, t) if mlp else P(),
                               "w_up": P(None, None, t) if mlp else P(),
                               "w_down": P(None, None, t) if split["hidden"] else P()})
        shapes = self.param_shapes(cfg)
        specs: dict[str, Any] = {
            "layers": {k: base["layers"].get(k, P()) for k in shapes["layers"]},
            "embed": base["embed"], "final_norm": P()}
        if "lm_head" in shapes:
            specs["lm_head"] = base["lm_head"]
        return specs

    # ---- calibration -----------------------------------------------------------------
    def product_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        attn = attention_products(cfg, tp)
        return attn[:4] + dense_mlp_products(cfg, tp) + attn[4:]

    def grouped_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        return []

    # ---- compute ---------------------------------------------------------------------
    def compute_params(self, params: dict[str, Any], cfg: ModelConfig,
                       plan: InvariancePlan | None, token_sizes: tuple[int, ...]
                       ) -> dict[str, Any]:
        """`primitives.with_transposed` for `plan` (None: every layout, stacked
        transposes too: for code that runs several plans), the layer matrices the plan runs
        natively alike at every step size fused (`llama.fused_groups`)."""
        from multiserve.model.families.llama import (
            fused_groups,
            plan_kernels,
            scan_needs_plain,
            scan_needs_transposes,
            scans,
        )
        from multiserve.model.invariance.primitives import LAYER_MATRICES, with_transposed

        if plan is None:
            return with_transposed(params, cfg, stacked_t=True)
        kernels = plan_kernels(plan, LAYER_MATRICES)
        # without per-layer copies the unrolled decoder reads the stacks too
        stacks = not plan.layer_copies
        return with_transposed(params, cfg,
                               stacked_t=(scan_needs_transposes(plan, cfg, token_sizes)
                                          or (stacks and "nt" in kernels)),
                               kernels=kernels,
                               head_kernels=plan_kernels(plan, ("head",)),
                               fused=fused_groups(plan, tuple(token_sizes)),
                               stacked_plain=(scan_needs_plain(plan, tuple(token_sizes), cfg)
                                              or (stacks and "plain" in kernels)),
                               layer_copies=plan.layer_copies,
                               unrolled=not token_sizes or not all(
                                   scans(plan, t, cfg) for t in token_sizes))

    def params_to_hold(self, params: dict[str, Any], compute: dict[str, Any]
                       ) -> dict[str, Any]:
        """`params` without the layer matrices `compute` holds only as native panels (not
        in its `stacked_layers`: `with_transposed`'s `stacked_plain`)."""
        stacked = compute["stacked_layers"]
        return {**params, "layers": {k: v for k, v in params["layers"].items()
                                     if k in stacked}}

    def canonical_params(self, held: dict[str, Any], compute: dict[str, Any],
                         cfg: ModelConfig) -> dict[str, Any]:
        """The canonical params from `params_to_hold`'s tree and `compute`: the layer
        matrices it left out rebuilt from their panels, bit for bit
        (`primitives.canonical_layer_matrices`)."""
        from multiserve.model.invariance.primitives import canonical_layer_matrices

        shapes = layer_param_shapes(cfg)
        layers = held["layers"]
        matrices = _layer_matrix_shapes(cfg)
        missing = tuple(k for k in matrices if k not in layers)
        rebuilt = canonical_layer_matrices(compute["stacked_layers"], matrices, missing) \
            if missing else {}
        return {**held, "layers": {k: layers[k] if k in layers else rebuilt[k]
                                   for k in shapes}}

    def canonical_leaf(self, held: dict[str, Any], compute: dict[str, Any],
                       cfg: ModelConfig, path: tuple[str, ...]) -> Any:
        """`canonical_params`' leaf at `path`: held, or that layer matrix alone rebuilt."""
        from multiserve.model.invariance.primitives import canonical_layer_matrices

        if path[0] == "layers" and len(path) == 2 and path[1] not in held["layers"]:
            matrices = _layer_matrix_shapes(cfg)
            return canonical_layer_matrices(compute["stacked_layers"], matrices,
                                            (path[1],))[path[1]]
        return get_leaf(held, path)

    def forward_hidden(self, params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                       cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                       plan: InvariancePlan, tp: TensorParallel | None = None
                       ) -> tuple[jax.Array, KVPool]:
        from multiserve.model.families.llama import forward_hidden

        return forward_hidden(params, kv_pool, batch, cfg, page_size=page_size,
                              attn_block_size=attn_block_size, plan=plan, tp=tp)

    def forward_hidden_routed(self, params: dict[str, Any], kv_pool: KVPool,
                              batch: ForwardBatch,
                              cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                              plan: InvariancePlan, tp: TensorParallel | None = None
                              ) -> tuple[jax.Array, KVPool, jax.Array]:
        raise ValueError(f"{cfg.architecture} is dense: it routes no tokens to experts")

    def lm_head(self, params: dict[str, Any], h: jax.Array, plan: InvariancePlan,
                cfg: ModelConfig) -> jax.Array:
        from multiserve.model.families.llama import lm_head

        return lm_head(params, h, plan, cfg)

    def scans(self, plan: InvariancePlan, num_tokens: int) -> bool:
        from multiserve.model.families.llama import scans

        return scans(plan, num_tokens)

    @property
    def unroll_max_tokens(self) -> int:
        from multiserve.model.families.llama import UNROLL_MAX_TOKENS

        return UNROLL_MAX_TOKENS
