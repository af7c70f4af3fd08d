"""The params pytree layout (shapes only), by the model's family, and random params for
tests. Numpy only, no jax.

Each family documents its layout (model/families/dense.py, qwen_moe.py): a plain dict,
leaves stacked over their layers, matmul weights [in, out].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.families import family_for

NORM_KEYS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm", "post_attn_norm",
             "post_mlp_norm")


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The full params pytree with a shape tuple at every leaf (the family's layout)."""
    return family_for(cfg).param_shapes(cfg)


def init_random_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32,
                       scale: float = 0.05) -> dict[str, Any]:
    """Random params (numpy, host): weights ~ N(0, scale^2), norm weights ~ 1 + N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)

    def make(key: str, shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        x = 1.0 + 0.1 * x if key in NORM_KEYS else scale * x
        return x.astype(dtype)

    shapes = param_shapes(cfg)
    # the top-level leaves first, then each group of stacked leaves ("layers", ...)
    params: dict[str, Any] = {k: make(k, s) for k, s in shapes.items()
                              if not isinstance(s, dict)}
    for group, leaves in shapes.items():
        if isinstance(leaves, dict):
            params[group] = {k: make(k, s) for k, s in leaves.items()}
    return params
