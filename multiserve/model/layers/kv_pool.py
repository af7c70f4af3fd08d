"""The paged KV pool: device arrays holding every layer's keys and values.

Layout: `KVPool.k` and `KVPool.v`, each [num_layers, kv_heads, num_pages * page_size, head_dim]
("head-major": slot = page * page_size + offset; one page of one head is a contiguous
[page_size, head_dim] slab, which is what attention gathers). Page 0 is reserved by
convention as the garbage page padding tokens write into; it is never read as real data.

Invariants: zero-initialised (the pool never holds NaN/inf, so masked keys contribute exact
zeros); the forward updates it in place when the caller donates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from multiserve.config import ModelConfig


@struct.dataclass
class KVPool:
    k: jax.Array  # [L, kv_heads, num_slots, head_dim]
    v: jax.Array  # [L, kv_heads, num_slots, head_dim]

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes of KV one token occupies across all layers (K and V)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def make_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                 sharding: jax.sharding.Sharding | None = None) -> KVPool:
    """A zeroed pool of `num_pages` pages (page 0 included) of `page_size` tokens each.

    `sharding` (e.g. from `sharding.kv_pool_sharding`) places each of k and v; the zeros are
    created directly with that sharding, never materialised on one device first.
    """
    assert num_pages >= 2 and page_size >= 1, (num_pages, page_size)
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages * page_size, cfg.head_dim)
    dtype = jnp.dtype(dtype)

    def zeros() -> jax.Array:
        return jnp.zeros(shape, dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)
    return KVPool(k=make(), v=make())


def write_layer(kv: KVPool, layer: int | jax.Array, slots: jax.Array, k: jax.Array,
                v: jax.Array, *, native: bool) -> KVPool:
    """The pool with one layer's new K and V ([T, KV, hd] each) written at `slots` [T].

    A float32 pool (or any pool off the native CPU kernels) takes XLA's scatter, in place
    when donated. A lower-precision pool where the native kernels run (`native`: the plan's
    attention is the native kernel) is written by `kv_write_native`: XLA:CPU has no bf16
    arithmetic and would convert the whole pool to float32 and back on every write. Both
    copy the rows' bits, so the pool's contents are the same either way."""
    if native and kv.k.dtype != jnp.float32:
        from multiserve.model.kernels.native import kv_write_native

        return KVPool(k=kv_write_native(kv.k, k, layer, slots),
                      v=kv_write_native(kv.v, v, layer, slots))
    # head-major pool [L, KV, slots, hd]: the indexed result is [T, KV, hd], k's own shape
    return KVPool(k=kv.k.at[layer, :, slots].set(k.astype(kv.k.dtype)),
                  v=kv.v.at[layer, :, slots].set(v.astype(kv.v.dtype)))
