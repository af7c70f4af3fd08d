"""Paged, batch-invariant causal attention: the ONE function a device kernel may replace.

Kernels, chosen by the engine's `AttentionPlan` (calibrated, model/invariance/calibration.py):
"native", the CPU kernel of kernels/native.py (reads K/V in place, invariant by
construction); "pallas_gpu" / "pallas_tpu", JAX's Pallas paged-attention kernels on those
platforms (attention_pallas.py: reads K/V in place, invariant by construction); and "xla",
the pure-JAX formulation below (every platform).

`paged_attention` computes, for every new token t of sequence s = token_seq[t] at position
p = positions[t], softmax(q_t . K_s / sqrt(head_dim)) V_s over the keys at positions <= p,
reading K/V from the paged pool (the new tokens' K/V are already written there), with the
layer's `AttentionTerms` (attention_terms.py: another scale, a sliding window, sinks, a
score soft cap), in every kernel (on a GPU a layer with terms runs our Triton kernel,
attention_gpu.py; a plain one JAX's library kernel).

Pool layout (kv_pool.py): head-major [L, KV, slots, hd], so one page of one head is a
contiguous [page_size, hd] slab and a block gather lands directly in the [KV, C, bs, hd]
order the contractions use (no transpose copies, which cost a large share of a decode step:
docs/performance.md §2).

Batch invariance (the engine's greedy determinism rests on it), by construction:
- Tokens are processed in chunks of C query rows (`lax.map`; T is padded up), C and the
  padded T given for each step size by the engine's `AttentionPlan` (invariance/plan.py).
  Which (T, C) give every row the same bits is a backend fact that differs between
  machines (docs/performance.md §2), so the plan is calibrated on the machine that runs the
  engine (model/invariance/calibration.py).
  Every contraction is batched over (head, token) and contracts only head_dim or the key
  block, so a token's result is independent of the other tokens in its chunk.
- Keys are visited in blocks of `block_size` consecutive positions aligned to position 0
  (block j = [j*bs, (j+1)*bs)), for j < nb, a TRACED loop bound (no recompiles per length):
  nb = max over the chunk of p // bs + 1.
- Each block is an online-softmax update in fp32 from (max = the finite MASK_VALUE, or the
  head's sink; sum = 0, or 1 with a sink); keys past p, and before the row's window, score
  -inf. A block with no key of the row is then an exact identity update: the max stays
  (max(m, -inf) = m, alpha = exp(0) = 1), every weight is exp(-inf) = 0 and adds +0 to
  the sums (the pool is zero-initialised and holds only finite values, so 0 * v = +-0).
  Hence a token's result does not depend on how many blocks its chunk visited, before or
  after its own keys.
- A windowed chunk starts at the block of its rows' earliest window start, so it reads
  no page that has left every row's window (the engine frees such pages: their page-table
  entries may name the garbage page 0 or another request's page; no row weighs them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.model.invariance.plan import AttentionPlan
from multiserve.model.invariance.primitives import EXACT, row_sum_rows
from multiserve.model.kernels.native import paged_attention_native
from multiserve.model.layers.attention_pallas import PALLAS_KERNELS, paged_attention_pallas
from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms, first_key
from multiserve.model.layers.forward_batch import ForwardBatch

MASK_VALUE = -1e30  # the running max's start: finite, so a masked score (-inf) minus it
# is -inf (weight exactly 0), never inf - inf
# Query chunk sizes the calibration tries (model/invariance/calibration.py).
QUERY_CHUNKS = (1, 2, 4, 8, 16)
# dot_general dims, batch (KV, C): [KV,C,G,hd] x [KV,C,bs,hd] -> [KV,C,G,bs], and back
_SCORES = (((3,), (3,)), ((0, 1), (0, 1)))
_VALUES = (((3,), (2,)), ((0, 1), (0, 1)))  # [KV,C,G,bs] x [KV,C,bs,hd] -> [KV,C,G,hd]


def _gather_block(k_pool: jax.Array, v_pool: jax.Array, layer: int | jax.Array, rows: jax.Array,
                  j: jax.Array, *, page_size: int,
                  block_size: int) -> tuple[jax.Array, jax.Array]:
    """K and V of key block j for each chunk row's sequence: [KV, C, bs, hd] float32.

    Whole pages are gathered when a block spans pages (contiguous [ps, hd] slabs), single
    slots otherwise. Page indices past the page table are clamped; those keys are masked.
    """
    c, max_pages = rows.shape
    num_layers, kv_heads, num_slots, head_dim = k_pool.shape
    heads = layer * kv_heads + jnp.arange(kv_heads)  # rows of the [L*KV, ...] view
    if block_size >= page_size:
        assert block_size % page_size == 0, (block_size, page_size)
        per_block = block_size // page_size
        page_idx = jnp.minimum(j * per_block + jnp.arange(per_block), max_pages - 1)
        pages = rows[:, page_idx]  # [C, per_block]
        shape = (num_layers * kv_heads, num_slots // page_size, page_size, head_dim)

        def take(pool: jax.Array) -> jax.Array:
            blk = pool.reshape(shape)[heads[:, None, None], pages[None]]  # [KV,C,pb,ps,hd]
            return blk.reshape(kv_heads, c, block_size, head_dim)
    else:
        key_pos = j * block_size + jnp.arange(block_size)
        page = rows[:, jnp.minimum(key_pos // page_size, max_pages - 1)]  # [C, bs]
        slots = page * page_size + key_pos % page_size
        shape = (num_layers * kv_heads, num_slots, head_dim)

        def take(pool: jax.Array) -> jax.Array:
            return pool.reshape(shape)[heads[:, None, None], slots[None]]  # [KV, C, bs, hd]

    return take(k_pool).astype(jnp.float32), take(v_pool).astype(jnp.float32)


def _chunk_attention(q: jax.Array, pos: jax.Array, seq: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: int | jax.Array, page_table: jax.Array, *,
                     page_size: int, block_size: int, shared_keys: bool,
                     terms: AttentionTerms) -> jax.Array:
    """One chunk: q [KV, C, G, hd] f32 (pre-scaled), pos/seq [C] -> out [KV, C, G, hd] f32.

    When every row of the chunk belongs to one sequence (a prefill chunk), each key block
    is gathered once and broadcast to the C rows instead of gathered C times: the same
    values in the same [KV, C, bs, hd] operand, so the contractions (and the bits) are
    those of the per-row path. The broadcast is materialised behind an optimization
    barrier so the compiler cannot fold it into a differently shaped contraction
    (tests/model/test_row_invariance.py compares both paths bitwise).
    """
    kv_heads, c, group, head_dim = q.shape
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    rows = page_table[seq]  # [C, max_pages]
    num_blocks = jnp.max(pos) // block_size + 1
    if terms.windowed:  # each row's first key; the chunk starts at its earliest's block
        window = jnp.asarray(terms.window, jnp.int32)
        lo = first_key(pos, window)
        first_block = jnp.min(lo) // block_size
    else:
        lo, first_block = None, 0

    def per_row(j: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _gather_block(k_pool, v_pool, layer, rows, j, page_size=page_size,
                             block_size=block_size)

    def shared(j: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = _gather_block(k_pool, v_pool, layer, rows[:1], j, page_size=page_size,
                             block_size=block_size)  # [KV, 1, bs, hd]
        full = (kv_heads, c, block_size, head_dim)
        return jax.lax.optimization_barrier((jnp.broadcast_to(k, full),
                                             jnp.broadcast_to(v, full)))

    def attend(gather):  # type: ignore[no-untyped-def]
        def body(j, carry):  # type: ignore[no-untyped-def]
            m, l, acc = carry  # [KV,C,G], [KV,C,G], [KV,C,G,hd]
            key_pos = j * block_size + offsets  # [bs]
            k, v = gather(j)  # [KV, C, bs, hd] f32
            s = jax.lax.dot_general(q, k, _SCORES, precision=EXACT)  # [KV, C, G, bs]
            if terms.softcap > 0:
                s = jnp.tanh(s / terms.softcap) * terms.softcap
            masked = key_pos[None, :] > pos[:, None]  # [C, bs]
            if lo is not None:
                masked = masked | (key_pos[None, :] < lo[:, None])
            s = jnp.where(masked[None, :, None, :], -jnp.inf, s)
            m_new = jnp.maximum(m, jnp.max(s, axis=3))  # max is exact: order-free
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            # jnp.sum's order varies with the operand's size: a product with ones, whose
            # invariance at this chunk size is part of what the attention plan checked
            l_new = l * alpha + row_sum_rows(p.reshape(-1, block_size),
                                             max(2, p.size // block_size)).reshape(m.shape)
            pv = jax.lax.dot_general(p, v, _VALUES, precision=EXACT)  # [KV, C, G, hd]
            return m_new, l_new, acc * alpha[..., None] + pv

        shape = (kv_heads, c, group)
        if terms.sinks is None:
            m0, l0 = jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
        else:  # head h = kv * G + g: the sink is the softmax's first term
            sink = terms.sinks.astype(jnp.float32).reshape(kv_heads, 1, group)
            m0, l0 = jnp.broadcast_to(sink, shape), jnp.ones(shape, jnp.float32)
        init = (m0, l0, jnp.zeros(shape + (head_dim,), jnp.float32))
        _, l, acc = jax.lax.fori_loop(first_block, num_blocks, body, init)
        return acc / l[..., None]

    if c == 1 or not shared_keys:
        return attend(per_row)
    return jax.lax.cond(jnp.all(seq == seq[0]), lambda: attend(shared),
                        lambda: attend(per_row))


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: int | jax.Array,
                    batch: ForwardBatch, *, page_size: int, block_size: int,
                    plan: AttentionPlan, terms: AttentionTerms = PLAIN_ATTENTION,
                    tp: Any = None, kv_heads: int | None = None) -> jax.Array:
    """q [T, H, hd] (already rotated) -> attention output [T, H, hd] in q's dtype.

    k_pool/v_pool are the whole pool [L, KV, slots, hd]; `layer` (an int or traced
    scalar) selects the layer inside the gathers, so no per-layer copy of the pool is made.
    `terms`: the layer's scale, window, sinks and soft cap (module docstring).
    `tp`: the engine's TensorParallel (None: one device), for a Pallas kernel's shard_map;
    `kv_heads`: the model's KV heads (the TPU kernel's pool rows may be padded).
    """
    if plan.kernel == "native":
        return paged_attention_native(q, k_pool, v_pool, layer, batch, page_size=page_size,
                                      terms=terms)
    if plan.kernel in PALLAS_KERNELS:
        return paged_attention_pallas(q, k_pool, v_pool, layer, batch, page_size=page_size,
                                      kernel=plan.kernel, interpret=plan.interpret, tp=tp,
                                      kv_heads=kv_heads, terms=terms)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = num_heads // kv_heads
    scale = terms.scale_for(head_dim)
    chunk, padded = plan.chunking(num_tokens)
    assert padded % chunk == 0 and padded >= num_tokens, (num_tokens, chunk, padded)
    n = padded // chunk
    # Row order (a row's result does not depend on its chunk: blocks past its position
    # are exact identity updates, so any order is correct; the order only sets cost):
    # by the first position its sequence has in this step, then sequence, then position.
    # Decode rows (one per sequence) thus sort by position, so each chunk loops only over
    # the key blocks its own longest row needs; a prefill's rows stay together, so its
    # chunks hold one sequence and gather each key block once (`_chunk_attention`).
    first = jnp.full(batch.page_table.shape[0], jnp.iinfo(jnp.int32).max, jnp.int32)
    first = first.at[batch.token_seq].min(batch.positions)[batch.token_seq]
    order = jnp.lexsort((batch.positions, batch.token_seq, first))
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(num_tokens, dtype=order.dtype))
    # Padding rows (T not a multiple of the chunk) sit at position 0 of sequence row 0:
    # one key block, results dropped.
    extra = padded - num_tokens
    qf = (q.astype(jnp.float32) * scale)[order]
    qf = jnp.pad(qf, ((0, extra), (0, 0), (0, 0))).reshape(n, chunk, kv_heads, group, head_dim)
    pos = jnp.pad(batch.positions[order], (0, extra)).reshape(n, chunk)
    seq = jnp.pad(batch.token_seq[order], (0, extra)).reshape(n, chunk)

    def one(args):
        qc, pc, sc = args
        return _chunk_attention(qc, pc, sc, k_pool, v_pool, layer, batch.page_table,
                                page_size=page_size, block_size=block_size,
                                shared_keys=plan.shared_keys, terms=terms)

    out = jax.lax.map(one, (jnp.transpose(qf, (0, 2, 1, 3, 4)), pos, seq))  # [n,KV,C,G,hd]
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(padded, num_heads, head_dim)
    return out[:num_tokens][inverse].astype(q.dtype)
