"""The paged KV pool: device arrays holding every layer's keys and values.

Two layouts (`KVPool.layout`), each the one its attention kernel reads in place:
- "heads" (the CPU's kernels, the XLA formulation, the GPU kernel): `KVPool.k` and
  `KVPool.v` each [num_layers, kv_heads, num_pages * page_size, head_dim] (slot = page *
  page_size + offset; one page of one head is a contiguous [page_size, head_dim] slab,
  which is what attention gathers);
- "lanes" (the TPU kernel, layers/attention_tpu.py): each [num_layers, num_slots,
  lanes_width] (kv_heads * head_dim, padded to whole 128-lane tiles on one device), a
  slot's every head side by side in the lanes: a page of one
  layer is one contiguous [page_size, KV * hd] slab of the whole pool, and a head_dim of
  64 fills 128-lane rows with two heads (XLA:TPU tiles an array's last dimension by 128
  lanes: a [.., 64] minor dimension would hold twice its bytes), so the kernel reads a
  layer's pages from the whole pool with no slice, copy or pad, and a step's K/V writes
  are one in-place scatter of whole rows.
`pool_layout(attention kernel)` says which. Page 0 is reserved by convention as the
garbage page padding tokens write into; it is never read as real data.

Invariants: zero-initialised (the pool never holds NaN/inf, so masked keys contribute exact
zeros); the forward updates it in place when the caller donates it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from multiserve.config import ModelConfig

LAYOUTS = ("heads", "lanes")


def pool_layout(attention_kernel: str) -> str:
    """The pool layout the attention kernel `attention_kernel` reads in place."""
    return "lanes" if attention_kernel == "pallas_tpu" else "heads"


LANE_TILE = 128  # XLA:TPU's lane tile: a "lanes" row is a whole number of them


def lanes_width(kv_heads: int, head_dim: int, split: bool = False) -> int:
    """The lanes of one "lanes" pool row: every head's, padded with zero lanes to whole
    128-lane tiles (SmolLM2's 3 x 64 -> 256: the bytes HBM's tiling holds anyway, and a
    row the kernel reads as it lies, where a 192-lane row is copied into the kernel's
    layout at every call), unpadded when the heads are `split` over devices (each device
    its own heads' lanes: a pad would land on the last device only)."""
    width = kv_heads * head_dim
    return width if split else -(-width // LANE_TILE) * LANE_TILE


def pool_shape(cfg: ModelConfig, num_slots: int, layout: str,
               split: bool = False) -> tuple[int, ...]:
    """The shape of each of K and V in `layout` (module docstring); `split`: the pool's
    heads are split over the devices (sharding.kv_pool_sharding)."""
    if layout == "lanes":
        return (cfg.num_layers, num_slots, lanes_width(cfg.num_kv_heads, cfg.head_dim, split))
    assert layout == "heads", layout
    return (cfg.num_layers, cfg.num_kv_heads, num_slots, cfg.head_dim)


def slot_axis(layout: str) -> int:
    """The axis of a pool array of `layout` that indexes slots."""
    return 1 if layout == "lanes" else 2


def to_lanes(heads: jax.Array, split: bool = False) -> jax.Array:
    """A "heads" pool array [L, KV, slots, hd] as the "lanes" layout [L, slots,
    lanes_width] (the same values, zero lanes after them; a copy)."""
    num_layers, kv_heads, slots, head_dim = heads.shape
    rows = jnp.transpose(heads, (0, 2, 1, 3)).reshape(num_layers, slots, kv_heads * head_dim)
    pad = lanes_width(kv_heads, head_dim, split) - kv_heads * head_dim
    return jnp.pad(rows, ((0, 0), (0, 0), (0, pad))) if pad else rows


@struct.dataclass
class KVPool:
    k: jax.Array  # pool_shape(cfg, num_slots, layout)
    v: jax.Array
    layout: str = struct.field(pytree_node=False, default="heads")

    @property
    def num_slots(self) -> int:
        return self.k.shape[slot_axis(self.layout)]


def kv_bytes_per_token(cfg: ModelConfig, dtype, layout: str = "heads",
                       split: bool = False) -> int:
    """Bytes one token's K and V occupy across all layers in a pool of `layout` (`split`:
    its heads split over devices, as pool_shape): in "lanes" a row's zero lanes included
    (SmolLM2's 3 x 64 values held in 256 lanes), the bytes the pool holds."""
    width = lanes_width(cfg.num_kv_heads, cfg.head_dim, split) if layout == "lanes" \
        else cfg.num_kv_heads * cfg.head_dim
    return 2 * cfg.num_layers * width * jnp.dtype(dtype).itemsize


def make_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                 sharding: jax.sharding.Sharding | None = None,
                 layout: str = "heads") -> KVPool:
    """A zeroed pool of `num_pages` pages (page 0 included) of `page_size` tokens each, in
    `layout` (module docstring).

    `sharding` (e.g. from `sharding.kv_pool_sharding`) places each of k and v; the zeros are
    created directly with that sharding, never materialised on one device first.
    """
    assert num_pages >= 2 and page_size >= 1, (num_pages, page_size)
    split = isinstance(sharding, jax.sharding.NamedSharding) and any(
        axis is not None for axis in sharding.spec)
    shape = pool_shape(cfg, num_pages * page_size, layout, split)
    dtype = jnp.dtype(dtype)

    def zeros() -> jax.Array:
        return jnp.zeros(shape, dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)
    return KVPool(k=make(), v=make(), layout=layout)


def write_layer(kv: KVPool, layer: int | jax.Array, slots: jax.Array, k: jax.Array,
                v: jax.Array, *, native: bool) -> KVPool:
    """The pool with one layer's new K and V ([T, KV, hd] each) written at `slots` [T].

    A float32 pool (or any pool off the native CPU kernels) takes XLA's scatter, in place
    when donated. A lower-precision pool where the native kernels run (`native`: the plan's
    attention is the native kernel) is written by `kv_write_native`: XLA:CPU has no bf16
    arithmetic and would convert the whole pool to float32 and back on every write. Both
    copy the rows' bits, so the pool's contents are the same either way."""
    if kv.layout == "lanes":  # whole rows [T, lanes]: one in-place scatter a layer
        t, pad = k.shape[0], kv.k.shape[2] - k.shape[1] * k.shape[2]

        def row(x: jax.Array) -> jax.Array:
            x = x.reshape(t, -1).astype(kv.k.dtype)
            return jnp.pad(x, ((0, 0), (0, pad))) if pad else x

        return dataclasses.replace(kv, k=kv.k.at[layer, slots].set(row(k)),
                                   v=kv.v.at[layer, slots].set(row(v)))
    if native and kv.k.dtype != jnp.float32:
        from multiserve.model.kernels.native import kv_write_native

        return KVPool(k=kv_write_native(kv.k, k, layer, slots),
                      v=kv_write_native(kv.v, v, layer, slots))
    # head-major pool [L, KV, slots, hd]: the indexed result is [T, KV, hd], k's own shape
    return KVPool(k=kv.k.at[layer, :, slots].set(k.astype(kv.k.dtype)),
                  v=kv.v.at[layer, :, slots].set(v.astype(kv.v.dtype)))


def read_slots(pool: jax.Array, layout: str, slots: Any) -> Any:
    """The values of every layer (and head) at `slots` of one pool array of `layout`, as
    a host (numpy) copy in that layout's order (`write_slots` puts them back)."""
    import numpy as np

    index = (slice(None),) * slot_axis(layout) + (slots,)
    return np.array(pool[index], copy=True)


def write_slots(pool: jax.Array, layout: str, slots: jax.Array,
                values: jax.Array) -> jax.Array:
    """`pool` with `values` (read_slots' array) written back at `slots` (traced)."""
    if layout == "lanes":
        return pool.at[:, slots].set(values)
    return pool.at[:, :, slots].set(values)
