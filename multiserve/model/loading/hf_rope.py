"""(no jax) An HF config's rope scaling entry (`rope_scaling`, or transformers 5's
`rope_parameters`) <-> config.RopeScaling: none, llama3, linear or yarn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from multiserve.config import RopeScaling
from multiserve.model.errors import ModelLoadError


def rope_scaling_from_hf(raw: dict[str, Any] | None, source: Path) -> RopeScaling | None:
    """A config's `rope_scaling` (or `rope_parameters`) entry: None, llama3 or linear."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(factor=float(raw["factor"]), rope_type="linear")
    if kind == "yarn":
        return _yarn(raw, source)
    if kind != "llama3":
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} (only "
                             "llama3, linear and yarn)")
    return RopeScaling(factor=float(raw["factor"]),
                       low_freq_factor=float(raw["low_freq_factor"]),
                       high_freq_factor=float(raw["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           raw["original_max_position_embeddings"]))


def _yarn(raw: dict[str, Any], source: Path) -> RopeScaling:
    """YaRN's entry; `attention_factor`, where absent, as transformers infers it from the
    factor (0.1 ln(factor) + 1; mscale / mscale_all_dim are DeepSeek's, not read here)."""
    if raw.get("mscale") or raw.get("mscale_all_dim") or raw.get(
            "partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: yarn with mscale or a partial rotary factor is "
                             "not supported")
    factor = float(raw["factor"])
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return RopeScaling(factor=factor, rope_type="yarn",
                       original_max_position_embeddings=int(
                           raw["original_max_position_embeddings"]),
                       beta_fast=float(raw.get("beta_fast") or 32.0),
                       beta_slow=float(raw.get("beta_slow") or 1.0),
                       truncate=bool(raw.get("truncate", True)),
                       attention_factor=float(attention))


def rope_scaling_to_hf(rs: RopeScaling) -> dict[str, Any]:
    """The config.json `rope_scaling` entry of a RopeScaling."""
    if rs.rope_type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.rope_type == "yarn":
        return {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow, "truncate": rs.truncate,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "attention_factor": rs.attention_factor}
    return {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
