"""The backend facts the engine's determinism rests on, checked directly on this JAX/XLA.

Each primitive must give every row bitwise the same result whatever the number of rows it
is computed with (1 to 128). These are properties of the backend's kernels (measured on
XLA:CPU, jax 0.10; see multiserve/model/row_invariant.py), not of our code: when one of
these tests fails after a JAX/XLA upgrade or on another backend, the engine's outputs
would depend on batch composition. Fix the primitive (another formulation, padding),
never the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.attention import paged_attention
from multiserve.model.forward_batch import ForwardBatch
from multiserve.model.llama import rms_norm
from multiserve.model.row_invariant import PLAIN_MIN_ROWS, dense, row_sum

ROW_COUNTS = (1, 2, 3, 5, 8, 16, 48, 64)
# (in, out) of every contraction of SmolLM2-135M (q, k/v, gate/up, down, lm_head), a
# Qwen2-0.5B-like MLP and the tiny test models
CONTRACTIONS = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152),
                (2048, 896), (4864, 896), (64, 32), (128, 64), (64, 256)]


def _rows_match(f, x: np.ndarray, counts=ROW_COUNTS) -> list[int]:
    """Row counts M at which f(x[:M]) differs from the first M rows of f(x)."""
    jf = jax.jit(f)
    full = np.asarray(jf(x))
    return [m for m in counts if not np.array_equal(np.asarray(jf(x[:m])), full[:m])]


@pytest.mark.parametrize("din,dout", CONTRACTIONS)
def test_dense_rows_do_not_depend_on_row_count(din: int, dout: int) -> None:
    rng = np.random.default_rng(din * 7 + dout)
    w = (rng.standard_normal((din, dout), dtype=np.float32) * 0.05)
    w_t = np.ascontiguousarray(w.T)
    x = rng.standard_normal((128, din), dtype=np.float32)
    bad = _rows_match(lambda a: dense(a, w, w_t), x)
    assert bad == [], f"dense {din}x{dout}: rows differ at M={bad}"
    # the two kernels dense picks between really agree (M == 1 is the GEMV)
    one = np.asarray(jax.jit(lambda a: dense(a, w, w_t))(x[:1]))
    two = np.asarray(jax.jit(lambda a: dense(a, w, w_t))(x[:2]))
    assert np.array_equal(one[0], two[0])


@pytest.mark.parametrize("din,dout", CONTRACTIONS)
def test_plain_product_sums_like_nt_product_from_64_rows(din: int, dout: int) -> None:
    """The scanned decoder of >= 64-token steps uses the plain product on the stacked W
    (dense with w_t None): its rows must equal the NT product's at every such size."""
    rng = np.random.default_rng(din * 5 + dout)
    w = (rng.standard_normal((din, dout), dtype=np.float32) * 0.05)
    w_t = np.ascontiguousarray(w.T)
    x = rng.standard_normal((512, din), dtype=np.float32)
    nt = np.asarray(jax.jit(lambda a: dense(a, w, w_t))(x))
    bad = [m for m in (PLAIN_MIN_ROWS, 65, 128, 256, 512)
           if not np.array_equal(np.asarray(jax.jit(lambda a: dense(a, w, None))(x[:m])),
                                 nt[:m])]
    assert bad == [], f"plain {din}x{dout}: rows differ from the NT product at M={bad}"


@pytest.mark.parametrize("width", [16, 64, 128, 576, 1536, 49152])
def test_row_sum_and_rms_norm_do_not_depend_on_row_count(width: int) -> None:
    rng = np.random.default_rng(width)
    x = rng.standard_normal((128, width), dtype=np.float32)
    assert _rows_match(row_sum, x) == []
    weight = 1.0 + 0.1 * rng.standard_normal(width, dtype=np.float32)
    assert _rows_match(lambda a: rms_norm(a, weight, 1e-5), x) == []
    # the value is the sum (only the order of additions is fixed)
    np.testing.assert_allclose(np.asarray(row_sum(x[:3])), x[:3].sum(axis=1), rtol=1e-4,
                               atol=1e-3)


@pytest.mark.parametrize("kv_heads,group,head_dim,page_size,block",
                         [(3, 3, 64, 16, 128), (2, 2, 16, 4, 16), (2, 7, 64, 16, 64)])
def test_paged_attention_rows_do_not_depend_on_step_size(kv_heads: int, group: int,
                                                         head_dim: int, page_size: int,
                                                         block: int) -> None:
    rng = np.random.default_rng(head_dim + group)
    pages_per_seq, num_seqs = 24, 64
    slots = (1 + pages_per_seq * num_seqs) * page_size
    k_pool = rng.standard_normal((2, kv_heads, slots, head_dim), dtype=np.float32)
    v_pool = rng.standard_normal((2, kv_heads, slots, head_dim), dtype=np.float32)
    table = (1 + np.arange(num_seqs * pages_per_seq, dtype=np.int32)).reshape(num_seqs, -1)
    q = rng.standard_normal((num_seqs, kv_heads * group, head_dim), dtype=np.float32)
    pos = rng.integers(0, pages_per_seq * page_size, num_seqs).astype(np.int32)

    def attend(qs: jax.Array) -> jax.Array:
        t = qs.shape[0]
        batch = ForwardBatch(input_ids=jnp.zeros(t, jnp.int32), positions=jnp.asarray(pos[:t]),
                             token_seq=jnp.arange(t, dtype=jnp.int32),
                             out_slots=jnp.zeros(t, jnp.int32), page_table=jnp.asarray(table),
                             seq_lens=jnp.zeros(num_seqs, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return paged_attention(qs, jnp.asarray(k_pool), jnp.asarray(v_pool), 1,
                               batch, page_size=page_size, block_size=block)

    bad = _rows_match(attend, q, counts=(1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 48))
    assert bad == [], f"attention rows differ at T={bad}"


@pytest.mark.parametrize("kv_heads,group,head_dim,page_size,block",
                         [(3, 3, 64, 16, 128), (2, 2, 16, 4, 16)])
def test_prefill_chunks_with_shared_keys_equal_lone_rows(kv_heads: int, group: int,
                                                         head_dim: int, page_size: int,
                                                         block: int) -> None:
    """A step mixing two prefills (whose 16-row chunks hold one sequence and gather each
    key block once, broadcast to the rows) with decode rows of other sequences: every
    row bitwise equals the same row attended alone (a 1-row step, per-row gather)."""
    rng = np.random.default_rng(head_dim)
    pages_per_seq, num_seqs = 24, 8
    slots = (1 + pages_per_seq * num_seqs) * page_size
    k_pool = jnp.asarray(rng.standard_normal((2, kv_heads, slots, head_dim), dtype=np.float32))
    v_pool = jnp.asarray(rng.standard_normal((2, kv_heads, slots, head_dim), dtype=np.float32))
    table = jnp.asarray((1 + np.arange(num_seqs * pages_per_seq, dtype=np.int32))
                        .reshape(num_seqs, -1))
    # seq 1: positions 0..69 (a fresh prefill); seq 4: 30..99 (a chunk after a cached
    # prefix); seqs 2, 5, 6: one decode row each
    seq = np.concatenate([np.full(70, 1), np.full(70, 4), [2, 5, 6]]).astype(np.int32)
    pos = np.concatenate([np.arange(70), np.arange(30, 100), [200, 13, 95]]).astype(np.int32)
    perm = rng.permutation(len(seq))  # the step's row order must not matter either
    seq, pos = seq[perm], pos[perm]
    q = jnp.asarray(rng.standard_normal((len(seq), kv_heads * group, head_dim),
                                        dtype=np.float32))

    @jax.jit
    def attend(qs: jax.Array, ps: jax.Array, ss: jax.Array) -> jax.Array:
        t = qs.shape[0]
        batch = ForwardBatch(input_ids=jnp.zeros(t, jnp.int32), positions=ps, token_seq=ss,
                             out_slots=jnp.zeros(t, jnp.int32), page_table=table,
                             seq_lens=jnp.zeros(num_seqs, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return paged_attention(qs, k_pool, v_pool, 1, batch, page_size=page_size,
                               block_size=block)

    full = np.asarray(attend(q, jnp.asarray(pos), jnp.asarray(seq)))
    bad = [i for i in range(len(seq))
           if not np.array_equal(np.asarray(attend(q[i:i + 1], jnp.asarray(pos[i:i + 1]),
                                                   jnp.asarray(seq[i:i + 1]))), full[i:i + 1])]
    assert bad == [], f"rows differ from their lone computation: {bad}"
