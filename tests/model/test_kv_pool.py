"""The KV pool: zero-initialised, written exactly at the batch's out_slots (nothing else
changes), and updated in place: the donated pool's buffers are the step's output buffers
(no copy of the pool, whatever its size)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from model_helpers import TINY_LLAMA, PagedSim

from multiserve.model.layers.kv_pool import kv_bytes_per_token, make_kv_pool
from multiserve.model.loading.param_layout import init_random_params


def test_pool_layout_and_bytes() -> None:
    pool = make_kv_pool(TINY_LLAMA, num_pages=8, page_size=4, dtype=jnp.bfloat16)
    # head-major: [L, KV, slots, hd]
    assert pool.k.shape == pool.v.shape == (2, 2, 32, 16) and pool.k.dtype == jnp.bfloat16
    assert not np.any(np.asarray(pool.k, np.float32))
    assert kv_bytes_per_token(TINY_LLAMA, jnp.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(TINY_LLAMA, "float32") == 2 * 2 * 2 * 16 * 4


def test_bytes_per_token_count_a_lanes_row_padding() -> None:
    """What the pool sizing budgets is what the pool holds: a "lanes" row of 2 x 16 values is
    held in 128 lanes on one device (4x the values), unpadded when its heads are split."""
    pool = make_kv_pool(TINY_LLAMA, num_pages=8, page_size=4, dtype=jnp.bfloat16,
                        layout="lanes")
    per = kv_bytes_per_token(TINY_LLAMA, jnp.bfloat16, "lanes")
    assert per == 2 * 2 * 128 * 2 and pool.k.nbytes + pool.v.nbytes == per * 8 * 4
    assert kv_bytes_per_token(TINY_LLAMA, jnp.bfloat16, "lanes", split=True) == 2 * 2 * 32 * 2
    assert kv_bytes_per_token(TINY_LLAMA, jnp.bfloat16, "heads") == \
        kv_bytes_per_token(TINY_LLAMA, jnp.bfloat16)


def test_forward_writes_only_its_slots() -> None:
    params = jax.device_put(init_random_params(TINY_LLAMA, seed=1))
    sim = PagedSim(params, TINY_LLAMA, page_size=4, block_size=8, num_pages=64)
    sim.add("a", list(range(3, 40)))
    sim.step([("a", 10)], T=64)
    before_k, before_v = np.asarray(sim.kv.k), np.asarray(sim.kv.v)
    sim.step([("a", 5)], T=64)
    after_k, after_v = np.asarray(sim.kv.k), np.asarray(sim.kv.v)
    pages = sim.seqs["a"].pages
    written = {pages[p // 4] * 4 + p % 4 for p in range(10, 15)} | {0}  # slot 0: padding
    changed = {int(s) for s in np.nonzero(np.any(after_k != before_k, axis=(0, 1, 3)))[0]}
    changed |= {int(s) for s in np.nonzero(np.any(after_v != before_v, axis=(0, 1, 3)))[0]}
    assert changed - {0} == written - {0}
    assert np.all(np.isfinite(after_k)) and np.all(np.isfinite(after_v))


def test_decode_step_updates_the_pool_in_place() -> None:
    params = jax.device_put(init_random_params(TINY_LLAMA, seed=1))
    sim = PagedSim(params, TINY_LLAMA, page_size=16, block_size=16, num_pages=4096)
    sim.add("a", list(range(3, 200)))
    sim.step([("a", 100)], T=128)
    for _ in range(2):
        k, v = sim.kv.k, sim.kv.v
        where = (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer())
        sim.step([("a", 1)], T=64)
        # donated: the input pool is consumed and its buffers hold the output pool
        assert k.is_deleted() and v.is_deleted()
        assert (sim.kv.k.unsafe_buffer_pointer(), sim.kv.v.unsafe_buffer_pointer()) == where
