"""(no jax) An HF config's rope scaling entry (`rope_scaling`, or transformers 5's
`rope_parameters`) <-> config.RopeScaling: none, llama3 or linear."""

from __future__ import annotations

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
    if kind != "llama3":
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} (only "
                             "llama3 and linear)")
    return RopeScaling(factor=float(raw["factor"]),
                       low_freq_factor=float(raw["low_freq_factor"]),
                       high_freq_factor=float(raw["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           raw["original_max_position_embeddings"]))


def rope_scaling_to_hf(rs: RopeScaling) -> dict[str, Any]:
    """The config.json `rope_scaling` entry of a RopeScaling."""
    if rs.rope_type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    return {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
