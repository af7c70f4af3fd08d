"""(no jax) GPT-OSS (`GptOssForCausalLM`) behind the model interface (families/base.py).

Attention: q/k/v/o biases, one learned sink logit per head and layer (in the softmax's
denominator, with no value: layers/attention_terms.py), sliding-window layers alternating
with full ones (`layer_types`; by default the even layers slide), YaRN rope. Every layer a
mixture of experts: a router with a bias, top-k of its logits then a softmax over those
k, experts with biases and a clamped SwiGLU, gate and up fused in one interleaved matrix
(gpt_oss_moe.py). RMSNorm scales by its weight in float32. The released checkpoints store
the experts in MXFP4 (`*_blocks` / `*_scales`): de-quantized at load (loading/mxfp4.py),
exactly, then rounded to the serving dtype (bfloat16: exact).

Params layout (plain dict; matmul weights [in, out]):
  embed [V, D]; final_norm [D]; lm_head [D, V]
  layers (stacked over L): attn_norm, wq, wk, wv, wo, bq, bk, bv, mlp_norm (dense.py's),
          bo [L, D], sinks [L, H]
  moe (stacked over L): router [L, D, E], router_b [L, E]; we_gateup [L, E, D, 2F] (gate
          in the even columns, up in the odd: transformers' own layout), be_gateup
          [L, E, 2F]; we_down [L, E, F, D], be_down [L, E, D]
The forward is moe_decoder.py's (its expert block gpt_oss_moe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.base import HfTensorSpec, ProductShape
from multiserve.model.families.dense import (
    ATTENTION_HF_NAMES,
    attention_layer_shapes,
    attention_products,
    top_level,
    top_level_specs,
)
from multiserve.model.families.qwen_moe import (
    QwenMoeFamily,
    attention_and_top_specs,
    expert_split,
)
from multiserve.model.families.sliding import layer_types_to_hf, sliding_from_hf
from multiserve.model.loading import mxfp4
from multiserve.model.tp_splits import tp_splits

if TYPE_CHECKING:  # the step's types (jax): for the checker only, this module stays jax-free
    from jax.sharding import Mesh

ARCH = "gpt_oss"
EXTRA_ATTENTION_HF_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("bo", "self_attn.o_proj.bias", False), ("sinks", "self_attn.sinks", False))
# (our key, HF suffix under model.layers.{i}.mlp., transposed); the expert tensors are one
# HF tensor per layer, [E, in, out] as ours
MOE_HF_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("router", "router.weight", True), ("router_b", "router.bias", False),
    ("we_gateup", "experts.gate_up_proj", False),
    ("be_gateup", "experts.gate_up_proj_bias", False),
    ("we_down", "experts.down_proj", False), ("be_down", "experts.down_proj_bias", False))
QUANTIZED = ("experts.gate_up_proj", "experts.down_proj")  # MXFP4 in released checkpoints


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention params (no leading L axis)."""
    return {**attention_layer_shapes(cfg), "bo": (cfg.hidden_size,), "sinks": (cfg.num_heads,)}


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's router and experts (no leading L axis)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {"router": (d, e), "router_b": (e,), "we_gateup": (e, d, 2 * f),
            "be_gateup": (e, 2 * f), "we_down": (e, f, d), "be_down": (e, d)}


class GptOssFamily(QwenMoeFamily):
    """GPT-OSS (see module docstring)."""

    name = "gpt_oss"
    architectures = {"GptOssForCausalLM": ARCH}
    model_types: tuple[str, ...] = (ARCH,)
    config_fields: tuple[str, ...] = QwenMoeFamily.config_fields + (
        "sliding_window", "sliding_layers", "swiglu_limit", "swiglu_alpha")

    # ---- config ----------------------------------------------------------------------
    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise ModelLoadError(f"{source}: {arch} quantized with {quant!r} is not "
                                 "supported (MXFP4 experts are)")
        experts = int(raw.get("num_local_experts") or 0)
        if experts <= 0:
            raise ModelLoadError(f"{source}: {arch} needs num_local_experts > 0")
        layers = common["num_layers"]
        window, sliding = sliding_from_hf(raw, layers, source, default_pattern=2)
        bias = bool(raw.get("attention_bias", True))
        return ModelConfig(
            architecture=arch, num_experts=experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=common["intermediate_size"],
            moe_layers=tuple(range(layers)), sliding_window=window, sliding_layers=sliding,
            attention_bias=bias, o_proj_bias=bias, attention_sinks=True,
            norm_weight_f32=True, swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), **common)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "sliding_window": cfg.sliding_window or None,
                "layer_types": layer_types_to_hf(cfg.num_layers, cfg.sliding_layers),
                "attention_bias": cfg.attention_bias, "swiglu_limit": cfg.swiglu_limit,
                "swiglu_alpha": cfg.swiglu_alpha}

    def unpack_hf_tensors(self, named: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """`named` with each MXFP4 expert tensor (`<name>_blocks`, `<name>_scales`)
        replaced by its float32 de-quantization under `<name>` (loading/mxfp4.py)."""
        out = dict(named)
        for name in [n for n in named if n.endswith(mxfp4.BLOCKS_SUFFIX)]:
            base = name[:-len(mxfp4.BLOCKS_SUFFIX)]
            scales = base + mxfp4.SCALES_SUFFIX
            if not base.endswith(QUANTIZED) or scales not in named:
                continue  # an unexpected tensor: params_from_hf names it
            try:
                out[base] = mxfp4.dequantize(named[name], named[scales])
            except ValueError as e:
                raise ModelLoadError(f"{base}: {e}") from e
            del out[name], out[scales]
        return out

    # ---- layout ----------------------------------------------------------------------
    def param_shapes(self, cfg: ModelConfig) -> dict[str, Any]:
        top = top_level(cfg)
        n = cfg.num_layers
        shapes: dict[str, Any] = {
            "embed": top["embed"],
            "layers": {k: (n, *s) for k, s in layer_shapes(cfg).items()},
            "final_norm": top["final_norm"],
            "moe": {k: (n, *s) for k, s in moe_shapes(cfg).items()}}
        if "lm_head" in top:
            shapes["lm_head"] = top["lm_head"]
        return shapes

    def hf_tensor_specs(self, cfg: ModelConfig) -> dict[str, HfTensorSpec]:
        before, after = top_level_specs(cfg)
        specs = dict(before)
        attn, moe = layer_shapes(cfg), moe_shapes(cfg)
        for i in range(cfg.num_layers):
            for key, suffix, transposed in ATTENTION_HF_NAMES + EXTRA_ATTENTION_HF_NAMES:
                if key in attn:
                    shape = attn[key][::-1] if transposed else attn[key]
                    specs[f"model.layers.{i}.{suffix}"] = HfTensorSpec(key, i, shape,
                                                                       transposed)
            for key, suffix, transposed in MOE_HF_NAMES:
                shape = moe[key][::-1] if transposed else moe[key]
                specs[f"model.layers.{i}.mlp.{suffix}"] = HfTensorSpec(key, i, shape,
                                                                       transposed, "moe")
        specs.update(after)
        return specs

    # ---- sharding --------------------------------------------------------------------
    def param_specs(self, cfg: ModelConfig, mesh: Mesh, moe_sharding: str) -> dict[str, Any]:
        from jax.sharding import PartitionSpec as P

        n = mesh.shape["tensor"]
        t = "tensor"
        split = tp_splits(cfg, n)
        specs = attention_and_top_specs(cfg, n, self.param_shapes(cfg), {
            "bo": P(None, t) if split["hidden"] else P(),
            "sinks": P(None, t) if split["attention"] else P()})
        shapes = self.param_shapes(cfg)
        down = P(None, None, None, t) if split["hidden"] else P()
        experts = {
            "intermediate": {"we_gateup": P(None, None, None, t), "be_gateup": P(None, None, t),
                             "we_down": down,
                             "be_down": P(None, None, t) if split["hidden"] else P()},
            "experts": {"we_gateup": P(None, t, None, None), "be_gateup": P(None, t, None),
                        "we_down": P(None, t, None, None), "be_down": P(None, t, None)},
        }.get(expert_split(cfg, n, moe_sharding), {})
        specs["moe"] = {k: experts.get(k, P()) for k in shapes["moe"]}
        return specs

    # ---- calibration -----------------------------------------------------------------
    def product_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        attn = attention_products(cfg, tp)
        return attn[:4] + [ProductShape("router", cfg.hidden_size, cfg.num_experts)] + \
            attn[4:]

    def grouped_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]:
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        inter = expert_split(cfg, tp, moe_sharding) == "intermediate"
        down = inter and tp_splits(cfg, tp)["hidden"]
        return [ProductShape("we_gateup", d, 2 * f, "out" if inter else ""),
                ProductShape("we_down", f, d, "out" if down else "")]
