"""Placement of params and the KV pool on a device group: a 1-D `jax.sharding.Mesh` with one
axis "tensor" (tensor parallelism over attention heads, MLP columns and the vocabulary).

Rule: a dimension is sharded over "tensor" only where it divides by the mesh size, else the
tensor is replicated. Attention (wq/wk/wv/wo, biases, KV pool heads) is sharded only when
both num_heads and num_kv_heads divide (SmolLM2's 9/3 heads: replicated at 2 or 4 devices);
the MLP shards its intermediate dim; embed/lm_head shard the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import ModelConfig
from multiserve.model.param_layout import param_shapes

AXIS = "tensor"


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A mesh over `devices` (order kept) with the single axis "tensor"."""
    assert len(devices) >= 1
    return Mesh(np.asarray(list(devices)), (AXIS,))


def _size(mesh: Mesh) -> int:
    return mesh.shape[AXIS]


def attention_sharded(cfg: ModelConfig, mesh: Mesh) -> bool:
    n = _size(mesh)
    return n > 1 and cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0


def param_specs(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """A PartitionSpec for every leaf of the params pytree (same structure)."""
    n = _size(mesh)
    attn = attention_sharded(cfg, mesh)
    mlp = n > 1 and cfg.intermediate_size % n == 0
    vocab = n > 1 and cfg.vocab_size % n == 0
    t = AXIS
    layer_specs = {
        "wq": P(None, None, t) if attn else P(), "wk": P(None, None, t) if attn else P(),
        "wv": P(None, None, t) if attn else P(), "wo": P(None, t, None) if attn else P(),
        "bq": P(None, t) if attn else P(), "bk": P(None, t) if attn else P(),
        "bv": P(None, t) if attn else P(),
        "w_gate": P(None, None, t) if mlp else P(), "w_up": P(None, None, t) if mlp else P(),
        "w_down": P(None, t, None) if mlp else P(),
    }
    shapes = param_shapes(cfg)
    specs: dict[str, Any] = {"layers": {k: layer_specs.get(k, P()) for k in shapes["layers"]},
                             "embed": P(t, None) if vocab else P(), "final_norm": P()}
    if "lm_head" in shapes:
        specs["lm_head"] = P(None, t) if vocab else P()
    return specs


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """NamedShardings for every leaf of the params pytree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict[str, Any], cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """Place params (numpy or jax arrays) on the mesh by `param_specs`."""
    return jax.device_put(params, param_shardings(cfg, mesh))


def kv_pool_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of each of KVPool.k / .v ([L, KV, slots, hd]): KV heads over "tensor" when
    attention is sharded, else replicated."""
    spec = P(None, AXIS, None, None) if attention_sharded(cfg, mesh) else P()
    return NamedSharding(mesh, spec)
