"""The forward's cross-device data movement on a tensor-parallel engine, with no float sum
across devices.

A GSPMD-partitioned product whose contraction dimension is split over the devices sums
each device's partial result with an all-reduce, whose summation order is the
collective's: in rank order for JAX's in-process CPU collectives, a ring (an element's
order depends on its place in the reduced buffer, i.e. on the batch size) for gloo's
between processes. A row's bits would then depend on its batch and its collectives.

So no product of the model splits its contraction (model/families: `param_specs` split
every matrix on its OUTPUT dimension, `tp_splits` says which), every array a product
must read whole is gathered first and the product's output after (`whole`: an all-gather
moves bits, it adds none). Each output element is then one device's sum over the whole
contraction, in its kernel's fixed order, whatever the batch and the collectives. The
embedding lookup from a vocabulary-split table (`embed_rows`) takes each token's row from
the device holding it: its bit pattern, zeros on the other devices, summed as integers
(exact in any order). The logits of the vocabulary-split head are gathered before the
sampler (engine/device/step_functions.py). A MoE split by experts (moe_sharding
"expert") gathers each row's expert matrix from the expert-split stacks as GSPMD
partitions that gather: a float all-reduce of one device's values and zeros, exact in
any order.

Invariant: the compiled step programs of an engine with a `TensorParallel` contain no
float all-reduce but expert parallelism's gathers (checked on a dense engine over two
processes by tests/multihost/test_multihost_engine.py, on a MoE engine by
tests/engine/test_moe_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import ModelConfig
from multiserve.model.tp_splits import tp_splits

AXIS = "tensor"  # the mesh's one axis (model/sharding.py)


@dataclass(frozen=True)
class TensorParallel:
    """The mesh of an engine over several devices, and whether its vocabulary is split."""

    mesh: Mesh
    vocab_split: bool
    attention_split: bool = False  # heads (and the KV pool's heads) split over the devices

    @staticmethod
    def of(mesh: Mesh, cfg: ModelConfig) -> TensorParallel | None:
        """The engine's TensorParallel; None on one device (nothing to move)."""
        n = mesh.shape[AXIS]
        if n == 1:
            return None
        split = tp_splits(cfg, n)
        return TensorParallel(mesh, split["vocab"], split["attention"])

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
    its ids up in its own block of V / n rows and keeps the rows of the ids it holds as
    unsigned 32-bit integers of their bits, zeros for the others; the devices' [T, D]
    integers are summed (an integer all-reduce, the buffer of a float32 one: one term is
    nonzero, so every order gives exactly its bits) and read back as floats: the table's
    own bits."""
    if tp is None or not tp.vocab_split:
        return embed[ids]
    n = tp.size
    per = embed.shape[0] // n
    blocks = tp.split(embed.reshape(n, per, embed.shape[1]))
    rows = tp.split(blocks[:, ids % per])  # [n, T, D]: device i's rows of block i
    assert embed.dtype.itemsize <= 4, embed.dtype
    word = jnp.dtype(f"uint{8 * embed.dtype.itemsize}")  # the float's bits, widened to
    bits = jax.lax.bitcast_convert_type(rows, word).astype(jnp.uint32)  # a 32-bit sum
    mine = jnp.arange(n)[:, None, None] == (ids // per)[None, :, None]
    total = jnp.sum(jnp.where(mine, bits, jnp.uint32(0)), axis=0, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(tp.whole(total).astype(word), embed.dtype)
