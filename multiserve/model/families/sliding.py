"""(no jax) Which layers of an HF config attend through a sliding window, and how far.

transformers spells it three ways: `layer_types` ("sliding_attention" / "full_attention",
one per layer: Gemma 2 / 3, GPT-OSS, Ministral, and every config written by transformers
5); a `sliding_window_pattern` n (Gemma 3 before it: layer i slides unless (i + 1) % n
== 0); or a bare `sliding_window` (Mistral: every layer slides). A null or 0 window slides
no layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multiserve.model.errors import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"


def sliding_from_hf(raw: dict[str, Any], num_layers: int, source: Path,
                    default_pattern: int = 0) -> tuple[int, tuple[int, ...]]:
    """(window, the sliding layers) of an HF config dict. `default_pattern` n > 0: without
    `layer_types` or a pattern, layer i slides unless (i + 1) % n == 0 (the family's
    default); 0: every layer slides."""
    window = int(raw.get("sliding_window") or 0)
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
            raise ModelLoadError(f"{source}: layer_types must name {num_layers} layers, each "
                                 f"{SLIDING!r} or {FULL!r}; got {types}")
        layers = tuple(i for i, t in enumerate(types) if t == SLIDING)
    else:
        pattern = int(raw.get("sliding_window_pattern") or default_pattern)
        layers = tuple(i for i in range(num_layers) if pattern <= 0 or (i + 1) % pattern)
    if not window:
        return 0, ()
    return window, layers


def layer_types_to_hf(num_layers: int, sliding: tuple[int, ...]) -> list[str]:
    """The config.json `layer_types` of the sliding layers `sliding`."""
    return [SLIDING if i in sliding else FULL for i in range(num_layers)]
