"""(no jax) Mixtral (`MixtralForCausalLM`): every layer a top-k mixture of experts (softmax
over the router's logits in float32, top-k, renormalised: Qwen3-MoE's routing with
`norm_topk_prob`), no shared expert, no q/k norms, an optional sliding window; behind the
model interface (families/base.py). Its weights keep the original checkpoint names
(block_sparse_moe's gate, and its experts' w1 / w3 / w2: gate, up, down), which
transformers also writes. Everything else is the Qwen MoE families' (qwen_moe.py: layout,
sharding, products; the forward is moe_decoder.py's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.qwen_moe import QwenMoeFamily
from multiserve.model.families.sliding import layer_types_to_hf, sliding_from_hf


class MixtralFamily(QwenMoeFamily):
    """Mixtral (see module docstring)."""

    name = "mixtral"
    architectures = {"MixtralForCausalLM": "mixtral"}
    model_types: tuple[str, ...] = ("mixtral",)
    config_fields: tuple[str, ...] = QwenMoeFamily.config_fields + ("sliding_window",
                                                                    "sliding_layers")
    router_hf_name = "block_sparse_moe.gate.weight"
    expert_hf_name = "block_sparse_moe.experts.{e}.{proj}.weight"
    expert_hf_names = (("we_gate", "w1"), ("we_up", "w3"), ("we_down", "w2"))

    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        if raw.get("mlp_bias") or raw.get("attention_bias"):
            raise ModelLoadError(f"{source}: mixtral with mlp_bias/attention_bias is not "
                                 "supported")
        experts = int(raw.get("num_local_experts") or 0)
        if experts <= 0:
            raise ModelLoadError(f"{source}: mixtral needs num_local_experts > 0")
        window, layers = sliding_from_hf(raw, common["num_layers"], source)
        return ModelConfig(
            architecture=arch, num_experts=experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True,
            moe_layers=tuple(range(common["num_layers"])), sliding_window=window,
            sliding_layers=layers, **common)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"num_local_experts": cfg.num_experts,
                               "num_experts_per_tok": cfg.num_experts_per_tok,
                               "sliding_window": cfg.sliding_window or None}
        if cfg.sliding_layers and len(cfg.sliding_layers) < cfg.num_layers:
            out["layer_types"] = layer_types_to_hf(cfg.num_layers, cfg.sliding_layers)
        return out
