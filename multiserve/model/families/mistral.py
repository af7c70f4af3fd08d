"""(no jax) Mistral (`MistralForCausalLM`): Llama's decoder with an optional sliding window
on every layer (or on the layers `layer_types` names), behind the model interface
(families/base.py). Everything but the config is the dense families' (dense.py: layout,
names, sharding, products; the forward is llama.py's, whose attention takes the window,
layers/attention_terms.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.dense import CONFIG_FIELDS, DenseFamily
from multiserve.model.families.sliding import layer_types_to_hf, sliding_from_hf

SLIDING_FIELDS = ("sliding_window", "sliding_layers")


class MistralFamily(DenseFamily):
    """Mistral (see module docstring)."""

    name = "mistral"
    architectures = {"MistralForCausalLM": "mistral"}
    model_types: tuple[str, ...] = ("mistral",)
    config_fields: tuple[str, ...] = CONFIG_FIELDS + SLIDING_FIELDS

    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        if raw.get("mlp_bias") or raw.get("attention_bias"):
            raise ModelLoadError(f"{source}: mistral with mlp_bias/attention_bias is not "
                                 "supported")
        window, layers = sliding_from_hf(raw, common["num_layers"], source)
        return ModelConfig(architecture=arch, sliding_window=window, sliding_layers=layers,
                           **common)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"sliding_window": cfg.sliding_window or None}
        if cfg.sliding_layers and len(cfg.sliding_layers) < cfg.num_layers:
            out["layer_types"] = layer_types_to_hf(cfg.num_layers, cfg.sliding_layers)
        return out
