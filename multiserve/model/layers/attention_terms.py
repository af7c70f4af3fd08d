"""What one layer's attention computes beyond softmax(q . K / sqrt(head_dim)) V over the
keys at positions <= p: its score scale, its sliding window, its attention sinks and its
score soft cap (`AttentionTerms`), the same for every attention kernel (attention.py's XLA
formulation, the native CPU kernel, our TPU and GPU Pallas kernels; JAX's library GPU
kernel serves the plain layers only).

- `scale`: the scores' factor (0: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5);
- `window` > 0: a query at position p sees keys p - window + 1 .. p only (transformers'
  sliding window: kv > q - window); 0: every key up to p. A Python int where the layer is
  known at trace time, an int32 scalar where the decoder scans its layers (0 for a global
  layer);
- `sinks` [H] (GPT-OSS): one extra logit per head in the softmax's denominator, with no
  value (the online softmax starts from max = sink, sum = 1); None: none;
- `softcap` > 0 (Gemma 2): each score s becomes softcap * tanh(s / softcap) before the
  mask; 0: none.

Every term is a function of the layer alone (and of the row's own position), so a row's
result still depends on nothing else in the step: row invariance is the kernels' as for
the plain terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig


@dataclass(frozen=True, eq=False)
class AttentionTerms:
    window: int | jax.Array = 0
    sinks: jax.Array | None = None
    scale: float = 0.0
    softcap: float = 0.0

    def scale_for(self, head_dim: int) -> float:
        """The scores' factor for heads of `head_dim`."""
        return self.scale if self.scale > 0 else 1.0 / float(head_dim) ** 0.5

    @property
    def windowed(self) -> bool:
        """Whether some query may see fewer keys than its position allows (a traced window
        may be 0 at run time: a global layer of a scanned decoder)."""
        return not isinstance(self.window, int) or self.window > 0

    @property
    def plain(self) -> bool:
        """No window, no sinks, no cap: what every attention kernel computes."""
        return not self.windowed and self.sinks is None and self.softcap <= 0


PLAIN_ATTENTION = AttentionTerms()


def first_key(positions: jax.Array, window: jax.Array) -> jax.Array:
    """The first key position a query at each of `positions` sees: its sliding window's
    start (`window` > 0: p - window + 1, at least 0), else 0."""
    return jnp.where(window > 0, jnp.maximum(positions - window + 1, 0), 0)


def layer_window(cfg: ModelConfig, layer: int | jax.Array) -> int | jax.Array:
    """Layer `layer`'s sliding window (0: none): a Python int where the layer is known at
    trace time or every layer has the same, else a lookup of the per-layer table."""
    if not cfg.sliding_layers or isinstance(layer, int):
        return cfg.layer_window(layer) if isinstance(layer, int) else 0
    if cfg.kv_window:  # every layer slides, by the same window
        return cfg.sliding_window
    table = jnp.asarray([cfg.layer_window(i) for i in range(cfg.num_layers)], jnp.int32)
    return table[layer]


def layer_terms(cfg: ModelConfig, layer: int | jax.Array,
                sinks: jax.Array | None = None) -> AttentionTerms:
    """The attention terms of layer `layer` of a model of `cfg`; `sinks`: the layer's
    sink logits [H] (its `sinks` param), used where the model has them."""
    scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar > 0 else 0.0
    return AttentionTerms(window=layer_window(cfg, layer), scale=scale,
                          softcap=cfg.attn_logit_softcapping,
                          sinks=sinks if cfg.attention_sinks else None)
