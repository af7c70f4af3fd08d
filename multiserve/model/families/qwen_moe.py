"""The mixture-of-experts families: Qwen3-MoE (`Qwen3MoeForCausalLM`: q/k RMSNorm, routed
experts, top-k softmax routing, `norm_topk_prob`) and Qwen2-MoE (`Qwen2MoeForCausalLM`:
q/k/v biases, plus a shared expert gated by sigmoid(x @ w)), behind the model interface
(families/base.py). Sparse layers: every `decoder_sparse_step`-th layer not listed in
`mlp_only_layers` (transformers' rule); the others run the dense SwiGLU MLP.

Params layout (plain dict; matmul weights [in, out]):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
  layers (stacked over all L layers): attn_norm, wq, wk, wv, wo, (bq, bk, bv), (q_norm,
          k_norm), mlp_norm - as the dense families (families/dense.py)
  dense_mlp (stacked over the Ld dense layers, only if any): w_gate, w_up [Ld, D, F],
          w_down [Ld, F, D]
  moe (stacked over the Lm sparse layers): router [Lm, D, E];
          we_gate, we_up [Lm, E, D, Fe]; we_down [Lm, E, Fe, D];
          qwen2_moe: ws_gate, ws_up [Lm, D, Fs], ws_down [Lm, Fs, D], ws_router [Lm, D, 1]
The forward is model/families/moe_decoder.py (the expert block: model/families/moe.py).

Sharding over an engine's device group (`moe_sharding`, EngineConfig): "tensor" splits
each expert's intermediate dim Fe (we_gate/we_up columns, we_down rows) like the dense
MLP's; "expert" splits the experts (axis E) over the devices. Either only where it
divides; attention, vocabulary and the dense layers follow the dense rules. Router and
shared expert are replicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.base import HfTensorSpec, ProductShape
from multiserve.model.families.dense import (
    ATTENTION_HF_NAMES,
    CONFIG_FIELDS,
    MLP_HF_NAMES,
    attention_layer_shapes,
    attention_products,
    attention_specs,
    dense_mlp_products,
    mlp_shapes,
    top_level,
    top_level_specs,
)
from multiserve.model.param_tree import get_leaf
from multiserve.model.tp_splits import tp_splits

if TYPE_CHECKING:  # the step's types (jax): for the checker only, this module stays jax-free
    import jax
    from jax.sharding import Mesh

    from multiserve.model.invariance.plan import InvariancePlan
    from multiserve.model.layers.forward_batch import ForwardBatch
    from multiserve.model.layers.kv_pool import KVPool
    from multiserve.model.tensor_parallel import TensorParallel

ARCH_QWEN3_MOE, ARCH_QWEN2_MOE = "qwen3_moe", "qwen2_moe"
EXPERT_HF_NAMES = (("we_gate", "gate_proj"), ("we_up", "up_proj"), ("we_down", "down_proj"))
SHARED_HF_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("ws_gate", "mlp.shared_expert.gate_proj.weight", True),
    ("ws_up", "mlp.shared_expert.up_proj.weight", True),
    ("ws_down", "mlp.shared_expert.down_proj.weight", True),
    ("ws_router", "mlp.shared_expert_gate.weight", True),
)


def sparse_layers(num_layers: int, num_experts: int, step: int,
                  mlp_only: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse iff it is not in mlp_only_layers and
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    return tuple(i for i in range(num_layers)
                 if i not in mlp_only and num_experts > 0 and step > 0 and (i + 1) % step == 0)


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One sparse layer's params (no leading Lm axis)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "router": (d, e), "we_gate": (e, d, f), "we_up": (e, d, f), "we_down": (e, f, d)}
    fs = cfg.shared_expert_intermediate_size
    if fs:
        shapes.update(ws_gate=(d, fs), ws_up=(d, fs), ws_down=(fs, d), ws_router=(d, 1))
    return shapes


def expert_split(cfg: ModelConfig, n: int, moe_sharding: str) -> str:
    """What a group of n devices splits of the experts: "intermediate" (tensor parallel,
    Fe divides), "experts" (expert parallel, E divides) or "" (replicated)."""
    if n <= 1:
        return ""
    if moe_sharding == "expert":
        return "experts" if cfg.num_experts % n == 0 else ""
    return "intermediate" if cfg.moe_intermediate_size % n == 0 else ""


def attention_and_top_specs(cfg: ModelConfig, n: int, shapes: dict[str, Any],
                            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The PartitionSpecs of the "layers" leaves in `shapes` (dense.attention_specs' rules,
    `extra` for leaves of a family's own; any other leaf replicated) and of the top-level
    ones."""
    from jax.sharding import PartitionSpec as P

    base = attention_specs(cfg, n)
    rules = {**base["layers"], **(extra or {})}
    specs: dict[str, Any] = {"layers": {k: rules.get(k, P()) for k in shapes["layers"]},
                             "embed": base["embed"], "final_norm": P()}
    if "lm_head" in shapes:
        specs["lm_head"] = base["lm_head"]
    return specs


class QwenMoeFamily:
    """Qwen3-MoE and Qwen2-MoE (see module docstring)."""

    name = "qwen_moe"
    architectures = {"Qwen3MoeForCausalLM": ARCH_QWEN3_MOE,
                     "Qwen2MoeForCausalLM": ARCH_QWEN2_MOE}
    model_types: tuple[str, ...] = (ARCH_QWEN3_MOE, ARCH_QWEN2_MOE)
    config_fields: tuple[str, ...] = CONFIG_FIELDS + ("num_experts", "num_experts_per_tok",
                                     "moe_intermediate_size", "norm_topk_prob", "moe_layers",
                                     "shared_expert_intermediate_size")
    # the HF names of a sparse layer's router and experts, under model.layers.{i}.
    router_hf_name = "mlp.gate.weight"
    expert_hf_name = "mlp.experts.{e}.{proj}.weight"
    expert_hf_names = EXPERT_HF_NAMES

    # ---- config ----------------------------------------------------------------------
    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        if raw.get("mlp_bias") or (arch == ARCH_QWEN3_MOE and raw.get("attention_bias")):
            raise ModelLoadError(f"{source}: {arch} with mlp_bias/attention_bias is not "
                                 "supported")
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        if experts <= 0:
            raise ModelLoadError(f"{source}: {arch} needs num_experts > 0")
        layers = sparse_layers(common["num_layers"], experts,
                               int(raw.get("decoder_sparse_step", 1)),
                               list(raw.get("mlp_only_layers") or []))
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if (
            arch == ARCH_QWEN2_MOE) else 0
        return ModelConfig(
            architecture=arch, attention_bias=arch == ARCH_QWEN2_MOE and bool(
                raw.get("qkv_bias", True)),
            qk_norm=arch == ARCH_QWEN3_MOE, num_experts=experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=layers,
            shared_expert_intermediate_size=shared, **common)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_mlp_layers)}
        if cfg.architecture == ARCH_QWEN2_MOE:
            out.update(qkv_bias=cfg.attention_bias,
                       shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
        else:
            out["attention_bias"] = False
        return out

    def unpack_hf_tensors(self, named: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The checkpoint's tensors as stored (nothing to unpack)."""
        return named

    # ---- layout ----------------------------------------------------------------------
    def param_shapes(self, cfg: ModelConfig) -> dict[str, Any]:
        top = top_level(cfg)
        shapes: dict[str, Any] = {
            "embed": top["embed"],
            "layers": {k: (cfg.num_layers, *s) for k, s in attention_layer_shapes(cfg).items()},
            "final_norm": top["final_norm"]}
        if cfg.dense_mlp_layers:
            ld = len(cfg.dense_mlp_layers)
            shapes["dense_mlp"] = {k: (ld, *s) for k, s in mlp_shapes(cfg).items()}
        lm = len(cfg.moe_layers)
        if lm:
            shapes["moe"] = {k: (lm, *s) for k, s in moe_shapes(cfg).items()}
        if "lm_head" in top:
            shapes["lm_head"] = top["lm_head"]
        return shapes

    def hf_tensor_specs(self, cfg: ModelConfig) -> dict[str, HfTensorSpec]:
        before, after = top_level_specs(cfg)
        specs = dict(before)
        attn = attention_layer_shapes(cfg)
        dense, moe = mlp_shapes(cfg), moe_shapes(cfg)
        dense_index = {i: j for j, i in enumerate(cfg.dense_mlp_layers)}
        moe_index = {i: j for j, i in enumerate(cfg.moe_layers)}

        def add(i: int, j: int, key: str, suffix: str, transposed: bool,
                shape: tuple[int, ...], group: str, expert: int | None = None) -> None:
            hf = shape[::-1] if transposed else shape
            specs[f"model.layers.{i}.{suffix}"] = HfTensorSpec(key, j, hf, transposed, group,
                                                               expert)

        for i in range(cfg.num_layers):
            for key, suffix, transposed in ATTENTION_HF_NAMES:
                if key in attn:
                    add(i, i, key, suffix, transposed, attn[key], "layers")
            if i in dense_index:
                for key, suffix, transposed in MLP_HF_NAMES:
                    add(i, dense_index[i], key, suffix, transposed, dense[key], "dense_mlp")
                continue
            j = moe_index[i]
            add(i, j, "router", self.router_hf_name, True, moe["router"], "moe")
            for e in range(cfg.num_experts):
                for key, proj in self.expert_hf_names:
                    add(i, j, key, self.expert_hf_name.format(e=e, proj=proj), True,
                        moe[key][1:], "moe", e)
            for key, suffix, transposed in SHARED_HF_NAMES:
                if key in moe:
                    add(i, j, key, suffix, transposed, moe[key], "moe")
        specs.update(after)
        return specs

    # ---- sharding --------------------------------------------------------------------
    def param_specs(self, cfg: ModelConfig, mesh: Mesh, moe_sharding: str) -> dict[str, Any]:
        from jax.sharding import PartitionSpec as P

        n = mesh.shape["tensor"]
        t = "tensor"
        split = tp_splits(cfg, n)
        mlp = split["mlp"]
        shapes = self.param_shapes(cfg)
        specs = attention_and_top_specs(cfg, n, shapes)
        if "dense_mlp" in shapes:
            specs["dense_mlp"] = {"w_gate": P(None, None, t) if mlp else P(),
                                  "w_up": P(None, None, t) if mlp else P(),
                                  "w_down": P(None, None, t) if split["hidden"] else P()}
        if "moe" in shapes:
            experts_split = expert_split(cfg, n, moe_sharding)
            experts = {
                "intermediate": {"we_gate": P(None, None, None, t),
                                 "we_up": P(None, None, None, t),
                                 "we_down": P(None, None, None, t) if split["hidden"]
                                 else P()},
                "experts": {k: P(None, t, None, None) for k in ("we_gate", "we_up", "we_down")},
            }.get(experts_split, {})
            specs["moe"] = {k: experts.get(k, P()) for k in shapes["moe"]}
        return specs

    # ---- calibration -----------------------------------------------------------------
    def product_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        attn = attention_products(cfg, tp)
        out = attn[:4]
        if cfg.dense_mlp_layers:
            out += dense_mlp_products(cfg, tp)
        d, e, fs = cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size
        out.append(ProductShape("router", d, e))
        if fs:
            out += [ProductShape("ws_gate", d, fs), ProductShape("ws_up", d, fs),
                    ProductShape("ws_down", fs, d), ProductShape("ws_router", d, 1)]
        return out + attn[4:]

    def grouped_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        inter = expert_split(cfg, tp, moe_sharding) == "intermediate"
        down = inter and tp_splits(cfg, tp)["hidden"]
        return [ProductShape("we_gate", d, f, "out" if inter else ""),
                ProductShape("we_up", d, f, "out" if inter else ""),
                ProductShape("we_down", f, d, "out" if down else "")]

    # ---- compute ---------------------------------------------------------------------
    def compute_params(self, params: dict[str, Any], cfg: ModelConfig,
                       plan: InvariancePlan | None, token_sizes: tuple[int, ...]
                       ) -> dict[str, Any]:
        """moe_decoder.compute_params with the layouts of the plan's kernels (None: all)."""
        from multiserve.model.families.llama import plan_kernels
        from multiserve.model.families.moe_decoder import compute_params
        from multiserve.model.invariance.plan import KERNELS

        if plan is None:
            return compute_params(params, cfg, frozenset(KERNELS), frozenset(KERNELS))
        matrices = tuple(p.name for p in plan.products if p.name != "head")
        return compute_params(params, cfg, plan_kernels(plan, matrices),
                              plan_kernels(plan, ("head",)), plan.layer_copies)

    def params_to_hold(self, params: dict[str, Any], compute: dict[str, Any]
                       ) -> dict[str, Any]:
        """`params` without the expert stacks [Lm, E, in, out] that `compute` holds as
        per-layer stacks [E, in, out] (moe_decoder.compute_params: the "gather" and "gmm"
        operands), which hold them exactly."""
        split = _split_experts(compute)
        if not split:
            return params
        return {**params, "moe": {k: v for k, v in params["moe"].items() if k not in split}}

    def canonical_params(self, held: dict[str, Any], compute: dict[str, Any],
                         cfg: ModelConfig) -> dict[str, Any]:
        """`held` with the expert stacks it left out restacked from their per-layer
        stacks, bit for bit (new arrays)."""
        missing = [k for k in _split_experts(compute) if k not in held["moe"]]
        if not missing:
            return held
        return {**held, "moe": {**held["moe"], **_restack(compute, cfg, tuple(missing))}}

    def canonical_leaf(self, held: dict[str, Any], compute: dict[str, Any],
                       cfg: ModelConfig, path: tuple[str, ...]) -> Any:
        """`canonical_params`' leaf at `path`: held, or that expert stack alone restacked."""
        if path[0] == "moe" and len(path) == 2 and path[1] not in held["moe"]:
            return _restack(compute, cfg, (path[1],))[path[1]]
        return get_leaf(held, path)

    def forward_hidden(self, params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                       cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                       plan: InvariancePlan, tp: TensorParallel | None = None
                       ) -> tuple[jax.Array, KVPool]:
        from multiserve.model.families.moe_decoder import forward_hidden

        return forward_hidden(params, kv_pool, batch, cfg, page_size=page_size,
                              attn_block_size=attn_block_size, plan=plan, tp=tp)

    def forward_hidden_routed(self, params: dict[str, Any], kv_pool: KVPool,
                              batch: ForwardBatch,
                              cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                              plan: InvariancePlan, tp: TensorParallel | None = None
                              ) -> tuple[jax.Array, KVPool, jax.Array]:
        from multiserve.model.families.moe_decoder import forward_hidden_routed

        return forward_hidden_routed(params, kv_pool, batch, cfg, page_size=page_size,
                                     attn_block_size=attn_block_size, plan=plan, tp=tp)

    def lm_head(self, params: dict[str, Any], h: jax.Array, plan: InvariancePlan,
                cfg: ModelConfig) -> jax.Array:
        from multiserve.model.families.llama import lm_head

        return lm_head(params, h, plan, cfg)

    def scans(self, plan: InvariancePlan, num_tokens: int) -> bool:
        return False  # always unrolled (moe_decoder.py)

    @property
    def unroll_max_tokens(self) -> int:
        """The dense decoder's bound (llama.UNROLL_MAX_TOKENS): the warm-up splits a MoE
        model's buckets as a dense model's, though every MoE step is unrolled."""
        from multiserve.model.families.llama import UNROLL_MAX_TOKENS

        return UNROLL_MAX_TOKENS


def _split_experts(compute: dict[str, Any]) -> tuple[str, ...]:
    """The expert matrices `compute` holds as per-layer stacks (moe_decoder.compute_params:
    every MoE layer's dict in `mlp` holds them, no other layer's)."""
    from multiserve.model.families import gpt_oss_moe, moe

    names = dict.fromkeys(moe.EXPERT_MATRICES + gpt_oss_moe.EXPERT_MATRICES)
    return tuple(k for k in names if any(k in layer for layer in compute.get("mlp", ())))


def _restack(compute: dict[str, Any], cfg: ModelConfig, names: tuple[str, ...]
             ) -> dict[str, jax.Array]:
    """The canonical expert stacks `names` [Lm, E, in, out] from their per-layer stacks."""
    import jax.numpy as jnp

    return {k: jnp.stack([compute["mlp"][i][k] for i in cfg.moe_layers]) for k in names}
