"""Placement of params and the KV pool on a device group: a 1-D `jax.sharding.Mesh` with one
axis "tensor" (tensor parallelism over attention heads, MLP columns and the vocabulary).

The rules are the model family's (`param_specs` of model/families/*). Dense rule: a
dimension is sharded over "tensor" only where it divides by the mesh size, else the
tensor is replicated. Every matrix is split on its OUTPUT dimension, never on its
contraction (no float sum across devices: model/tensor_parallel.py). Attention (wq/wk/wv,
biases, KV pool heads) is sharded only when both num_heads and num_kv_heads divide
(SmolLM2's 9/3 heads: replicated at 2 or 4 devices); gate/up shard the MLP's intermediate
dim, o_proj and down_proj the hidden size; embed/lm_head shard the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import ModelConfig
from multiserve.model.families import family_for
from multiserve.model.tp_splits import tp_splits

AXIS = "tensor"


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A mesh over `devices` (order kept) with the single axis "tensor"."""
    assert len(devices) >= 1
    return Mesh(np.asarray(list(devices)), (AXIS,))


def _size(mesh: Mesh) -> int:
    return mesh.shape[AXIS]


def attention_sharded(cfg: ModelConfig, mesh: Mesh) -> bool:
    return tp_splits(cfg, _size(mesh))["attention"]


def param_specs(cfg: ModelConfig, mesh: Mesh, moe_sharding: str = "tensor") -> dict[str, Any]:
    """A PartitionSpec for every leaf of the params pytree (same structure): the family's
    rules (model/families); `moe_sharding` says how a MoE family splits its experts."""
    return family_for(cfg).param_specs(cfg, mesh, moe_sharding)


def param_shardings(cfg: ModelConfig, mesh: Mesh, moe_sharding: str = "tensor"
                    ) -> dict[str, Any]:
    """NamedShardings for every leaf of the params pytree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh, moe_sharding),
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict[str, Any], cfg: ModelConfig, mesh: Mesh,
                 moe_sharding: str = "tensor") -> dict[str, Any]:
    """Place params (numpy or jax arrays) on the mesh by `param_specs`."""
    return jax.device_put(params, param_shardings(cfg, mesh, moe_sharding))


def kv_pool_sharding(cfg: ModelConfig, mesh: Mesh, layout: str = "heads") -> NamedSharding:
    """Sharding of each of KVPool.k / .v (layers/kv_pool.py: "heads" [L, KV, slots, hd],
    "lanes" [L, slots, KV * hd]): KV heads over "tensor" when attention is sharded (each
    device a contiguous run of heads' lanes in "lanes"), else replicated."""
    if not attention_sharded(cfg, mesh):
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(None, None, AXIS) if layout == "lanes"
                         else P(None, AXIS, None, None))
