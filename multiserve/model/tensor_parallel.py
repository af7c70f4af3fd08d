"""The forward's cross-device data movement on a tensor-parallel engine, with no float sum
across devices.

A GSPMD-partitioned product whose contraction dimension is split over the devices sums
each device's partial result with an all-reduce, whose summation order is the
collective's: in rank order for JAX's in-process CPU collectives, a ring (an element's
order depends on its place in the reduced buffer, i.e. on the batch size) for gloo's
between processes. A row's bits would then depend on its batch and its collectives.

So no product of the model splits its contraction (model/families: `param_specs` split
every matrix on its OUTPUT dimension, `tp_splits` says which), and every array a
product must read whole is gathered first (`whole`: an all-gather moves bits, it adds
none). Each output element is then one device's sum over the whole contraction, in its
kernel's order, the order a one-device engine computes it in. The embedding lookup from a
vocabulary-split table (`embed_rows`) takes each token's row from the device holding it
(gathered, then selected: no masked sum). The logits of the vocabulary-split head are
gathered before the sampler (engine/device/step_functions.py).

Invariant: the compiled step programs of an engine with a `TensorParallel` contain no
all-reduce (tests/multihost/test_multihost_engine.py checks them on two processes).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import ModelConfig
from multiserve.model.families.base import tp_splits

AXIS = "tensor"  # the mesh's one axis (model/sharding.py)


@dataclass(frozen=True)
class TensorParallel:
    """The mesh of an engine over several devices, and whether its vocabulary is split."""

    mesh: Mesh
    vocab_split: bool

    @staticmethod
    def of(mesh: Mesh, cfg: ModelConfig) -> TensorParallel | None:
        """The engine's TensorParallel; None on one device (nothing to move)."""
        n = mesh.shape[AXIS]
        return None if n == 1 else TensorParallel(mesh, tp_splits(cfg, n)["vocab"])

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    def whole(self, x: jax.Array) -> jax.Array:
        """x replicated on every device (an all-gather where it is split; else nothing)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))

    def split(self, x: jax.Array) -> jax.Array:
        """x split over the devices on its first axis (each keeps its own slice)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(AXIS)))


def whole(x: jax.Array, tp: TensorParallel | None) -> jax.Array:
    """`tp.whole(x)`; x itself on one device."""
    return x if tp is None else tp.whole(x)


def embed_rows(embed: jax.Array, ids: jax.Array, tp: TensorParallel | None) -> jax.Array:
    """embed[ids] ([T, D]), replicated. From a vocabulary-split table: every device looks
    its ids up in its own block of V / n rows (an id outside the block reads some row of
    it), the [n, T, D] results are gathered, and each token takes the row of the device
    holding its id: the table's own bits, moved, never summed."""
    if tp is None or not tp.vocab_split:
        return embed[ids]
    n = tp.size
    per = embed.shape[0] // n
    blocks = tp.split(embed.reshape(n, per, embed.shape[1]))
    local = tp.split(blocks[:, ids % per])  # [n, T, D]: device i's rows of block i
    gathered = tp.whole(local)
    return gathered[ids // per, jnp.arange(ids.shape[0])]
