"""The params pytree layout (shapes only) and random params for tests. Numpy only, no jax.

Layout (plain dict; "layers" leaves stacked over L layers; matmul weights are [in, out]):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when cfg.tie_word_embeddings)
  layers: attn_norm [L, D]; wq [L, D, H*hd]; wk, wv [L, D, KV*hd]; wo [L, H*hd, D];
          bq [L, H*hd], bk, bv [L, KV*hd]   (only when cfg.attention_bias)
          q_norm, k_norm [L, hd]            (only when cfg.qk_norm)
          mlp_norm [L, D]; w_gate, w_up [L, D, F]; w_down [L, F, D]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multiserve.config import ModelConfig

NORM_KEYS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's params (without the leading L axis), in a fixed order."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,), "wq": (d, qd), "wk": (d, kvd), "wv": (d, kvd), "wo": (qd, d)}
    if cfg.attention_bias:
        shapes.update(bq=(qd,), bk=(kvd,), bv=(kvd,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    shapes.update(mlp_norm=(d,), w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The full params pytree with a shape tuple at every leaf."""
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "layers": {k: (cfg.num_layers, *s) for k, s in layer_param_shapes(cfg).items()},
        "final_norm": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


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
    params: dict[str, Any] = {k: make(k, s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = {k: make(k, s) for k, s in shapes["layers"].items()}
    return params
