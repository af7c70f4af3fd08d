"""The model families behind the model interface (base.py), and the registry that finds
them: by our `ModelConfig.architecture`, or by an HF config's `architectures` (else its
`model_type`). Adding a family = one module here + its entry in FAMILIES + its tests
(sops/add-a-model.md)."""

from __future__ import annotations

from typing import Any

from multiserve.config import ModelConfig
from multiserve.model.families.base import ModelFamily
from multiserve.model.families.dense import DenseFamily
from multiserve.model.families.gemma import GemmaFamily
from multiserve.model.families.gpt_oss import GptOssFamily
from multiserve.model.families.mistral import MistralFamily
from multiserve.model.families.mixtral import MixtralFamily
from multiserve.model.families.qwen_moe import QwenMoeFamily

FAMILIES: tuple[ModelFamily, ...] = (DenseFamily(), QwenMoeFamily(), MistralFamily(),
                                     GemmaFamily(), MixtralFamily(), GptOssFamily())
# HF class name -> our architecture; our architecture -> its family
HF_ARCHITECTURES: dict[str, str] = {k: v for f in FAMILIES for k, v in f.architectures.items()}
_BY_ARCH: dict[str, ModelFamily] = {a: f for f in FAMILIES for a in f.architectures.values()}


def family_for(cfg: ModelConfig | str) -> ModelFamily:
    """The family serving a ModelConfig (or an architecture name)."""
    arch = cfg if isinstance(cfg, str) else cfg.architecture
    try:
        return _BY_ARCH[arch]
    except KeyError:
        raise KeyError(f"no model family serves architecture {arch!r} "
                       f"(known: {sorted(_BY_ARCH)})") from None


def architecture_of_hf(raw: dict[str, Any]) -> str | None:
    """Our architecture for an HF config.json dict: from `architectures`, or, when that is
    absent (e.g. a config saved from a GGUF-loaded model), from `model_type` as
    transformers does. None: no family serves it."""
    archs = raw.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None and not archs and raw.get("model_type") in _BY_ARCH:
        arch = raw["model_type"]
    return arch
