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
the step padded to another bucket give every token the bits it has in the step. The same
with the attention terms (a sliding window, traced or not, sinks, Gemma's scale and soft
cap), and a windowed step reads no page wholly before its windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.plan import AttentionPlan
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms
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


# The attention terms (layers/attention_terms.py) in the kernel: Gemma's score scale and
# soft cap with a sliding window shorter than the chunk's reach (a Python int), the window
# traced as a scanned decoder gives it (0 there: a global layer) with GPT-OSS's sinks.
WINDOW = 20


def _terms(kind: str, heads: int) -> AttentionTerms:
    sinks = jnp.asarray(np.random.default_rng(7).standard_normal(heads), jnp.float32)
    return {"gemma": AttentionTerms(window=WINDOW, scale=0.3, softcap=2.0),
            "sinks_traced": AttentionTerms(window=jnp.int32(WINDOW), sinks=sinks),
            "global_traced": AttentionTerms(window=jnp.int32(0), sinks=sinks)}[kind]


def _with_terms(q, k, v, pos, seq, table, terms, *, xla: bool):
    n = q.shape[0]
    if xla:
        batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32), positions=pos,
                             token_seq=seq, out_slots=jnp.zeros(n, jnp.int32),
                             page_table=table, seq_lens=jnp.zeros(table.shape[0], jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return paged_attention(q, k, v, 0, batch, page_size=PAGE, block_size=16,
                               plan=AttentionPlan(((n, (1, n)),), False), terms=terms)
    return ragged_attention_tpu(q, k, v, jnp.int32(0), pos, seq, table, page_size=PAGE,
                                kv_heads=q.shape[1] // 2, terms=terms, interpret=True)


@pytest.mark.parametrize("kind", ["gemma", "sinks_traced", "global_traced"])
def test_the_attention_terms_match_the_xla_formulation(kind: str) -> None:
    q, k, v = _case(64, 2, "float32")
    terms = _terms(kind, q.shape[1])
    args = (jnp.asarray(POS), jnp.asarray(SEQ), jnp.asarray(TABLE), terms)
    ref = _with_terms(q, k, v, *args, xla=True)
    out = _with_terms(q, to_lanes(k), to_lanes(v), *args, xla=False)
    err = float(jnp.max(jnp.abs(out - ref)))
    assert err <= 1e-5, (kind, err)
    plain = _with_terms(q, to_lanes(k), to_lanes(v), *args[:3], PLAIN_ATTENTION, xla=False)
    assert float(jnp.max(jnp.abs(out - plain))) > 1e-2  # the terms changed the result


def test_a_windowed_step_is_row_invariant_and_reads_no_page_before_its_windows() -> None:
    """Each sequence's pages of its own (every position in its table); the table entries
    wholly before the key block of its earliest window start name a page past the pool
    (Pallas interpret mode raises on any read out of bounds: none of them is fetched), and
    the bits are those of a table naming real pages there; the decode rows alone and the
    step reversed give their bits in the step."""
    q, _, _ = _case(64, 2, "bfloat16")
    table = np.arange(4 * 20, dtype=np.int32).reshape(4, 20)  # 320 positions a sequence
    rng = np.random.default_rng(3)
    k, v = (to_lanes(jnp.asarray(rng.standard_normal((1, 2, table.size * PAGE, 64)),
                                 jnp.bfloat16)) for _ in range(2))
    terms = _terms("sinks_traced", q.shape[1])

    def run(rows: np.ndarray, tab: np.ndarray) -> np.ndarray:
        return np.asarray(_with_terms(q[rows], k, v, jnp.asarray(POS[rows]),
                                      jnp.asarray(SEQ[rows]), jnp.asarray(tab), terms,
                                      xla=False))

    everything = np.arange(len(SEQ))
    full = run(everything, table)
    outside = table.copy()
    for s in np.unique(SEQ):
        start = max(int(POS[SEQ == s].min()) - WINDOW + 1, 0) // 128 * 128  # its first block
        outside[s, :start // PAGE] = 10 * table.size
    assert (outside != table).sum() >= 16
    np.testing.assert_array_equal(run(everything, outside), full)
    decode = np.nonzero(SEQ != 0)[0]  # the decode rows alone, the step reversed
    np.testing.assert_array_equal(run(decode, outside), full[decode])
    np.testing.assert_array_equal(run(everything[::-1], outside), full[::-1])
