"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) as a pure forward function.

`forward(params, kv_pool, batch, cfg, page_size=, attn_block_size=)` -> (logits f32 [R, V],
new kv_pool). No globals, no implicit context: jit it with cfg/page_size/attn_block_size
static and kv_pool donated; the pool is updated in place (scatter into the scan carry).

Params: the plain-dict pytree documented in `param_layout` (layers stacked over L).
Compute is in the params dtype, attention softmax/accumulation in fp32, logits in fp32.
One layer is a flax linen module applied with explicit params under `jax.lax.scan`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.attention import paged_attention
from multiserve.model.forward_batch import ForwardBatch
from multiserve.model.kv_pool import KVPool
from multiserve.model.param_layout import layer_param_shapes, param_shapes  # noqa: F401

Params = dict[str, Any]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight


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


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: attention over the paged pool, then a SwiGLU MLP."""

    cfg: ModelConfig
    page_size: int
    attn_block_size: int

    def _p(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        return self.param(name, nn.initializers.zeros_init(), shape)

    @nn.compact
    def __call__(self, x: jax.Array, kv: KVPool, layer: jax.Array, batch: ForwardBatch,
                 cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, KVPool]:
        cfg = self.cfg
        shapes = layer_param_shapes(cfg)
        w = {name: self._p(name, shape) for name, shape in shapes.items()}
        t, hd = x.shape[0], cfg.head_dim

        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        if cfg.attention_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q = q.reshape(t, cfg.num_heads, hd)
        k = k.reshape(t, cfg.num_kv_heads, hd)
        v = v.reshape(t, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        kv = KVPool(k=kv.k.at[layer, batch.out_slots].set(k.astype(kv.k.dtype)),
                    v=kv.v.at[layer, batch.out_slots].set(v.astype(kv.v.dtype)))
        attn = paged_attention(q, kv.k, kv.v, layer, batch, page_size=self.page_size,
                               block_size=self.attn_block_size)
        x = x + attn.reshape(t, cfg.num_heads * hd) @ w["wo"]

        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return x, kv


def forward(params: Params, kv_pool: KVPool, batch: ForwardBatch, cfg: ModelConfig, *,
            page_size: int, attn_block_size: int) -> tuple[jax.Array, KVPool]:
    """Run the new tokens of `batch` through the model; return (logits f32 [R, V], kv_pool)."""
    layer_mod = DecoderLayer(cfg, page_size, attn_block_size)
    x = params["embed"][batch.input_ids]
    freqs = batch.positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]

    def step(carry, xs):
        x, kv = carry
        layer_params, layer = xs
        x, kv = layer_mod.apply({"params": layer_params}, x, kv, layer, batch, cos, sin)
        return (x, kv), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv_pool), _ = jax.lax.scan(step, (x, kv_pool), (params["layers"], layer_ids))

    h = rms_norm(x[batch.logit_rows], params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        logits = jax.lax.dot_general(h, params["embed"], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    else:
        logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), kv_pool
