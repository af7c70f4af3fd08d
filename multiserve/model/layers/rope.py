"""Rotary position embeddings (rotate-half, HF's layout), computed in float32: llama3,
linear and yarn rope scaling (yarn's cos and sin scaled by its attention factor), and a
second, unscaled base for sliding-window layers (Gemma 3's local layers:
`ModelConfig.rope_local_theta`).

`rope_tables` computes a step's cos/sin once per base; `RopeTables.for_layer` picks a
layer's (by a lookup of the per-layer table where the layer is traced: a scanned decoder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Per-pair inverse frequencies [hd/2] (float32): the global layers' (rope_theta, rope
    scaling applied), or with `local` the sliding layers' own (rope_local_theta, unscaled)."""
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    rs = None if local else cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(theta, hd, rs)
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(theta: float, hd: int, rs: Any) -> np.ndarray:
    """YaRN's inverse frequencies, in transformers' float32 steps: each pair's
    extrapolated (1 / theta^(2i/hd)) and interpolated (that / factor) frequency, blended
    by a linear ramp over the pairs between the correction dimensions of beta_fast and
    beta_slow rotations (floored / ceiled with `truncate`)."""
    def correction_dim(rotations: float) -> float:
        return (hd * math.log(rs.original_max_position_embeddings
                              / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    pos = np.float32(theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))
    extrapolated = (np.float32(1.0) / pos).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rs.factor) * pos)).astype(np.float32)
    ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


@dataclass(frozen=True, eq=False)
class RopeTables:
    """cos/sin [T, 1, hd/2] of a step's positions: the global layers' and, where the
    sliding layers have their own base, theirs (`local`, else None)."""

    cos: jax.Array
    sin: jax.Array
    local: tuple[jax.Array, jax.Array] | None
    cfg: ModelConfig

    def for_layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) of layer `layer` (an int, or a traced index into the layer table)."""
        if self.local is None:
            return self.cos, self.sin
        if isinstance(layer, int):
            return self.local if layer in self.cfg.sliding_layers else (self.cos, self.sin)
        slides = jnp.asarray([i in self.cfg.sliding_layers
                              for i in range(self.cfg.num_layers)])[layer]
        return (jnp.where(slides, self.local[0], self.cos),
                jnp.where(slides, self.local[1], self.sin))


def _cos_sin(positions: jax.Array, inv: np.ndarray,
             factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    if factor != 1.0:  # yarn's attention factor
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> RopeTables:
    """The step's rope tables for `positions` [T]."""
    rs = cfg.rope_scaling
    factor = rs.attention_factor if rs is not None and rs.rope_type == "yarn" else 1.0
    cos, sin = _cos_sin(positions, rope_inv_freq(cfg), factor)
    local = (_cos_sin(positions, rope_inv_freq(cfg, local=True))
             if cfg.rope_local_theta > 0 and cfg.sliding_layers else None)
    return RopeTables(cos, sin, local, cfg)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [T, heads, hd]; cos/sin [T, 1, hd/2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
