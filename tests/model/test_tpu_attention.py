"""Our ragged paged attention TPU kernel (model/layers/attention_tpu.py) in Pallas
interpret mode on the CPU, at the engine's page size (16) and the kernel's pinned blocks
(8-token query blocks, 128-position key blocks), on the TPU's "lanes" pool: head_dim 64
(two kv heads in each 128-lane window), 128 (one), and three heads of 64 (SmolLM2's: a
row padded to 256 lanes, read as a fourth, zero head).

Against the XLA formulation (layers/attention.py, on the same values in the "heads"
layout) over a mixed step: a prefill chunk spanning three query blocks and several key
blocks, and decode rows of other sequences sharing its query blocks. Tolerances (max abs
difference, unit-variance q/K/V): float32 pool 1e-5 (reassociation only), bfloat16 pool
2e-2 (q and the probabilities rounded to bfloat16 for the products; outputs bfloat16).
Batch invariance bitwise: each decode row alone, the chunk alone, the step reversed, and
the step padded to another bucket give every token the bits it has in the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.plan import AttentionPlan
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_tpu import ragged_attention_tpu
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import to_lanes

PAGE, PAGES, WIDTH = 16, 40, 16  # WIDTH: page-table pages per sequence
# sequence 0: a prefill chunk at positions 250..268 (19 tokens: 3 query blocks, key blocks
# 1 and 2); sequences 1..3: decode rows at 300, 7 and 129, placed between its tokens
SEQ = np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3], np.int32)
POS = np.array([300] + list(range(250, 259)) + [7] + list(range(259, 269)) + [129],
               np.int32)
TABLE = (1 + np.arange(4 * WIDTH, dtype=np.int32).reshape(4, WIDTH) % (PAGES - 1))


def _case(head_dim: int, kv: int, dtype: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(head_dim + kv)
    q = rng.standard_normal((len(SEQ), 2 * kv, head_dim))
    k, v = (rng.standard_normal((1, kv, PAGES * PAGE, head_dim)) for _ in range(2))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))  # type: ignore[return-value]


@jax.jit
def _xla(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    n = q.shape[0]
    batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32), positions=jnp.asarray(POS),
                         token_seq=jnp.asarray(SEQ), out_slots=jnp.zeros(n, jnp.int32),
                         page_table=jnp.asarray(TABLE), seq_lens=jnp.zeros(4, jnp.int32),
                         logit_rows=jnp.zeros(1, jnp.int32))
    return paged_attention(q, k, v, 0, batch, page_size=PAGE, block_size=16,
                           plan=AttentionPlan(((n, (1, n)),), False))


@jax.jit
def _kernel(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array,
            seq: jax.Array) -> jax.Array:
    return ragged_attention_tpu(q, k, v, jnp.int32(0), pos, seq, jnp.asarray(TABLE),
                                page_size=PAGE, kv_heads=q.shape[1] // 2, interpret=True)


@pytest.mark.parametrize("head_dim,kv,dtype", [(64, 2, "float32"), (128, 1, "float32"),
                                               (64, 3, "float32")])
def test_matches_the_xla_formulation(head_dim: int, kv: int, dtype: str) -> None:
    q, k, v = _case(head_dim, kv, dtype)
    ref = _xla(q, k, v)
    out = _kernel(q, to_lanes(k), to_lanes(v), jnp.asarray(POS), jnp.asarray(SEQ))
    assert out.dtype == q.dtype and out.shape == q.shape
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err <= (1e-5 if dtype == "float32" else 2e-2), err


def test_rows_are_batch_invariant_bitwise() -> None:
    q, k, v = _case(64, 2, "bfloat16")
    k, v = to_lanes(k), to_lanes(v)

    def run(rows: np.ndarray, pad: int = 0) -> np.ndarray:
        """The kernel over the step's tokens `rows` (in that order), with `pad` padding
        tokens (sequence -1) after them."""
        qs = jnp.pad(q[rows], ((0, pad), (0, 0), (0, 0)))
        pos = np.concatenate([POS[rows], np.zeros(pad, np.int32)])
        seq = np.concatenate([SEQ[rows], np.full(pad, -1, np.int32)])
        return np.asarray(_kernel(qs, k, v, jnp.asarray(pos), jnp.asarray(seq)))[:len(rows)]

    everything = np.arange(len(SEQ))
    full = run(everything)
    # a bfloat16 pool against the XLA formulation (module docstring's tolerance)
    ref = np.asarray(_xla(q, *_case(64, 2, "bfloat16")[1:]).astype(jnp.float32))
    assert float(np.max(np.abs(full.astype(np.float32) - ref))) <= 2e-2
    for i in np.nonzero(SEQ != 0)[0]:  # each decode row alone
        np.testing.assert_array_equal(run(np.array([i]))[0], full[i])
    chunk = np.nonzero(SEQ == 0)[0]  # the prefill chunk alone: other query blocks
    np.testing.assert_array_equal(run(chunk), full[chunk])
    np.testing.assert_array_equal(run(everything[::-1]), full[::-1])
    np.testing.assert_array_equal(run(everything, pad=10), full)
