"""Rotary position embeddings (rotate-half, HF's layout), llama3 rope scaling included;
computed in float32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [hd/2] (float32), llama3 rope scaling applied."""
    hd = cfg.head_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(
        np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [T, heads, hd]; cos/sin [T, 1, hd/2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
