"""Ragged paged attention on a TPU: our own Pallas (Mosaic) kernel, reading the K/V pool
where it lies, one call for a whole step of prefill chunks and decode rows.

The pool it reads is the TPU's layout (kv_pool.py "lanes"): K and V each [L, slots, W],
W = KV * head_dim, one slot's every head side by side in the lanes, so a page of one
layer is one contiguous [page_size, W] slab of the whole pool (no layer is sliced or
copied out) and a head_dim of 64 holds two heads in each 128-lane row (no lane padding:
the pool's bytes are its values'). The new tokens' K/V are already in the pool.

The call (`ragged_attention_tpu`): q [T, H, hd], the step's positions, each token's
sequence row and the page table. The kernel's grid is (query blocks of QUERY_BLOCK
consecutive tokens, lane windows of the pool). A lane window is `window` lanes: one head
(head_dim >= 128), the heads sharing a 128-lane row (head_dim 64: two), or a whole row
that 128 lanes do not tile; each head takes its own lanes of a fetched block (a static
lane slice in VMEM). Per query block, each run of consecutive tokens of one sequence
fetches its sequence's key blocks (KEY_BLOCK_TOKENS consecutive positions, whole pages,
aligned to position 0) once, by DMA from the pool into VMEM, up to the run's last
position, and every token of the run takes the blocks up to its own position: a
512-token prefill chunk reads each key block once per 8 tokens, a decode row once.

The layer's attention terms (layers/attention_terms.py), all of them: the score scale on
q, the soft cap on each score before the mask, a sliding window (a scalar-prefetched int,
traced where the decoder scans its layers: 0 for a global layer) masking keys before the
window and bounding the blocks a token and its run visit from below (a run fetches no page
wholly before the key block of its earliest token's window start), and sinks (each head's
sink as its softmax's first term: max = sink, sum = 1).

Batch invariance, by construction: a token's result is an online softmax over ITS OWN key
blocks, from the one holding its first visible key (0, or its window's start) to
position // KEY_BLOCK_TOKENS, in that order, each block's scores and values computed for
that token alone (its own [group, head_dim] product with the block), the mask within its
first and last blocks: what shares its query block, its run, its step or its bucket never
enters a token's arithmetic (the first block a token takes holds a key it sees, so no
update starts from a fully masked block). The block sizes are pinned here, never chosen by
token count. Tested in Pallas interpret mode against the XLA formulation and bitwise
alone vs in a mixed step, plain and with every term (tests/model/test_tpu_attention.py,
test_attention_terms.py: against transformers' definitions in float64).

Cost estimate: every pallas_call carries a `pl.CostEstimate`, the compiler's count of the
kernel: q and the output, and the K/V of one page table per (query block, sequence) run
(at most min(T, B + blocks - 1) runs), read once: the bytes a step whose every sequence
fills its table reads (the floor's "K/V in use"); what it reads of a table at run time
depends on the lengths, which no static count knows.

Numerics: scores and values in float32 accumulation; q and the probabilities are cast to
the pool's dtype for the products (a bfloat16 pool: bfloat16 operands, as the MXU takes
them); 1/sqrt(head_dim) is applied to q in float32 first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms

QUERY_BLOCK = 8  # tokens of one query block (pinned)
KEY_BLOCK_TOKENS = 128  # positions of one key block (pinned; whole pages)
LANES = 128
MASK_VALUE = -1e30  # finite: exp(MASK_VALUE - m) == 0 exactly


def window_of(local_width: int, head_dim: int) -> int:
    """Lanes of one window of a pool row `local_width` lanes wide (KV heads on this
    device x head_dim): one head from 128 lanes up, else the heads sharing 128 lanes, or
    the whole row where 128 lanes do not tile it (narrower, or an odd count of 64-wide
    heads: SmolLM2's 3 x 64; such a row is padded to whole 128-lane tiles in HBM)."""
    if head_dim >= LANES:
        assert head_dim % LANES == 0, head_dim
        return head_dim
    assert LANES % head_dim == 0, head_dim
    return LANES if local_width % LANES == 0 else local_width


def pages_per_block(page_size: int) -> int:
    return max(1, KEY_BLOCK_TOKENS // page_size)


def _kernel(layer_ref, window_ref, pos_ref, seq_ref, table_ref,  # scalar prefetch (SMEM)
            q_ref, sink_ref, k_hbm, v_hbm,  # q [bq, 1, R, hd], sinks [1, R, LANES] (VMEM);
            o_ref,  # [bq, 1, R, hd]                                  pools (HBM)
            kbuf, vbuf, sem, m_ref, l_ref, acc_ref, *,
            page_size: int, per_block: int, max_pages: int, num_tokens: int, group: int,
            softcap: float, sinks: bool):
    bq, _, rows, head_dim = q_ref.shape
    lanes_width = kbuf.shape[1]
    per_window = rows // group
    block_keys = per_block * page_size
    i, w = pl.program_id(0), pl.program_id(1)
    start = i * bq
    layer = layer_ref[0]
    sliding = window_ref[0]  # the sliding window (0: every key up to the position)
    if sinks:  # each head's sink is its softmax's first term (max = sink, sum = 1)
        m_ref[...] = jnp.broadcast_to(sink_ref[...], m_ref.shape)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    # this program's lanes of the pool (static where the row is one window: a narrower
    # row than 128 lanes allows no other offset)
    lanes = (pl.ds(0, lanes_width) if k_hbm.shape[2] == lanes_width
             else pl.ds(pl.multiple_of(w * lanes_width, lanes_width), lanes_width))

    def first_key(pos: jax.Array) -> jax.Array:
        """The first key position a query at `pos` sees (its sliding window's start, or 0)."""
        return jnp.where(sliding > 0, jnp.maximum(pos - sliding + 1, 0), 0)

    def fetch(seq: jax.Array, j: jax.Array) -> None:
        """Key block j of sequence row `seq` (its pages) from the pool into VMEM."""
        copies = []
        for p in range(per_block):
            index = jnp.minimum(j * per_block + p, max_pages - 1)
            page = table_ref[seq * max_pages + index]
            rows = pl.ds(pl.multiple_of(page * page_size, page_size), page_size)
            dst = pl.ds(p * page_size, page_size)
            for src, buf, n in ((k_hbm, kbuf, 0), (v_hbm, vbuf, 1)):
                copy = pltpu.make_async_copy(src.at[layer, rows, lanes], buf.at[dst, :],
                                             sem.at[n])
                copy.start()
                copies.append(copy)
        for copy in copies:
            copy.wait()

    def attend(t: jax.Array, j: jax.Array) -> None:
        """Token t's online-softmax update with key block j (in VMEM), head by head of
        the window (each its own product with its own lanes of the block)."""
        r = t - start
        pos = pos_ref[t]
        for h in range(per_window):
            heads = pl.ds(h * group, group)
            own = pl.ds(h * head_dim, head_dim)
            q = q_ref[r, 0, heads, :]  # [G, hd]
            k = kbuf[:, own]  # [bk, hd]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # [G, bk]
            if softcap > 0:
                s = jnp.tanh(s / softcap) * softcap
            key_pos = j * block_keys + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(jnp.logical_and(key_pos <= pos, key_pos >= first_key(pos)), s,
                          MASK_VALUE)
            m_prev = m_ref[r, heads, :]  # [G, LANES] (every lane the same)
            l_prev = l_ref[r, heads, :]
            m_cur = jnp.max(s, axis=1, keepdims=True)  # [G, 1]
            m_next = jnp.maximum(m_prev, m_cur)  # [G, LANES]
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            l_ref[r, heads, :] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[r, heads, :] = m_next
            pv = jax.lax.dot_general(p.astype(vbuf.dtype), vbuf[:, own],
                                     (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [G, hd]
            acc_ref[r, heads, :] = acc_ref[r, heads, :] * alpha[:, :1] + pv

    def run_from(u: jax.Array, carry: jax.Array) -> jax.Array:
        """If token start + u begins a run (the block's first token, or its sequence
        differs from the token before it), serve the run: its sequence's key blocks up to
        its last position, each fetched once, taken by each of its tokens up to its own."""
        t = start + u
        seq = seq_ref[t]
        first = jnp.logical_or(u == 0, seq_ref[jnp.maximum(t - 1, 0)] != seq)

        @pl.when(jnp.logical_and(first, jnp.logical_and(seq >= 0, t < num_tokens)))
        def _() -> None:
            def extent(v: jax.Array, c: tuple[jax.Array, jax.Array, jax.Array]
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
                end, earliest, last = c
                tv = start + v
                inside = jnp.logical_and(
                    jnp.logical_and(v > u, v == end - start),
                    jnp.logical_and(tv < num_tokens, seq_ref[jnp.minimum(tv, num_tokens - 1)]
                                    == seq))
                at = pos_ref[jnp.minimum(tv, num_tokens - 1)]
                return (jnp.where(inside, end + 1, end),
                        jnp.where(inside, jnp.minimum(earliest, at), earliest),
                        jnp.where(inside, jnp.maximum(last, at), last))

            end, earliest, last = jax.lax.fori_loop(0, bq, extent,
                                                    (t + 1, pos_ref[t], pos_ref[t]))

            def block(j: jax.Array, c: jax.Array) -> jax.Array:
                fetch(seq, j)

                def token(tt: jax.Array, c2: jax.Array) -> jax.Array:
                    # the token's own blocks: from its window's first to its position's
                    # (the first it takes holds a key it sees, so no update starts from
                    # a fully masked block)
                    pos = pos_ref[tt]
                    @pl.when(jnp.logical_and(j * block_keys <= pos,
                                             (j + 1) * block_keys > first_key(pos)))
                    def _() -> None:
                        attend(tt, j)
                    return c2

                return jax.lax.fori_loop(t, end, token, c)

            # lax.div: positions are >= 0 (a floor division lowers through sign, which
            # Mosaic resolves against the host's device kind); a windowed run starts at
            # its earliest token's window, so it fetches no page that left every window
            jax.lax.fori_loop(jax.lax.div(first_key(earliest), block_keys),
                              jax.lax.div(last, block_keys) + 1, block, 0)

        return carry

    jax.lax.fori_loop(0, bq, run_from, 0)
    total = l_ref[...][:, :, :1]  # padding tokens: none (their output is dropped)
    o_ref[:, 0] = (acc_ref[...] / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def ragged_attention_tpu(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                         layer: jax.Array, positions: jax.Array, token_seq: jax.Array,
                         page_table: jax.Array, *, page_size: int, kv_heads: int,
                         terms: AttentionTerms = PLAIN_ATTENTION,
                         interpret: bool = False) -> jax.Array:
    """q [T, H, hd] (rotated) -> attention output [T, H, hd] in q's dtype, over the pool
    k_pool / v_pool [L, slots, lanes] of `kv_heads` heads (module docstring; lanes past
    them are zero padding, kv_pool.lanes_width); `layer` a scalar; `terms` the layer's
    score scale, sliding window (an int or a traced scalar), sinks [H] and soft cap."""
    num_tokens, num_heads, head_dim = q.shape
    width = k_pool.shape[2]
    group = num_heads // kv_heads
    slots = width // head_dim  # heads' places in a row: the padding's read as zero heads
    if slots > kv_heads:  # queries of the padding's heads: zeros, their outputs dropped
        q = jnp.pad(q, ((0, 0), (0, (slots - kv_heads) * group), (0, 0)))
    sinks = terms.sinks is not None
    sink_rows = (jnp.zeros(slots * group, jnp.float32) if terms.sinks is None else jnp.pad(
        terms.sinks.astype(jnp.float32), (0, (slots - kv_heads) * group)))
    lane_window = window_of(width, head_dim)
    per_window = lane_window // head_dim  # kv heads in a window
    windows = width // lane_window
    rows = per_window * group  # query rows of one token in one window
    bq = QUERY_BLOCK
    padded = -(-num_tokens // bq) * bq
    extra = padded - num_tokens
    qs = (q.astype(jnp.float32) * terms.scale_for(head_dim)).astype(k_pool.dtype)
    # [T, windows, heads of a window's kv heads, hd]: q's own order (kv head major)
    q_win = jnp.pad(qs.reshape(num_tokens, windows, rows, head_dim),
                    ((0, extra), (0, 0), (0, 0), (0, 0)))
    pos = jnp.pad(positions.astype(jnp.int32), (0, extra))
    seq = jnp.pad(token_seq.astype(jnp.int32), (0, extra), constant_values=-1)
    max_pages = page_table.shape[1]
    per_block = pages_per_block(page_size)
    block_keys = per_block * page_size
    item = jnp.dtype(k_pool.dtype).itemsize
    runs = min(padded, page_table.shape[0] + padded // bq - 1)
    table_keys = -(-max_pages // per_block) * block_keys
    cost = pl.CostEstimate(
        flops=4 * padded * num_heads * head_dim * table_keys,
        transcendentals=padded * num_heads * table_keys,
        bytes_accessed=2 * runs * table_keys * width * item + 2 * q_win.size * item)
    kernel = functools.partial(_kernel, page_size=page_size, per_block=per_block,
                               max_pages=max_pages, num_tokens=num_tokens, group=group,
                               softcap=float(terms.softcap), sinks=sinks)
    block = pl.BlockSpec((bq, 1, rows, head_dim), lambda i, w, *_: (i, w, 0, 0))
    # each head's sink in every lane of its row (m_ref's layout), a window's heads a block
    sink_win = jnp.broadcast_to(sink_rows.reshape(windows, rows, 1), (windows, rows, LANES))
    sink_block = pl.BlockSpec((1, rows, LANES), lambda i, w, *_: (w, 0, 0))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, windows, rows, head_dim), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(padded // bq, windows),
            in_specs=[block, sink_block, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=block,
            scratch_shapes=[pltpu.VMEM((block_keys, lane_window), k_pool.dtype),
                            pltpu.VMEM((block_keys, lane_window), v_pool.dtype),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((bq, rows, LANES), jnp.float32),
                            pltpu.VMEM((bq, rows, LANES), jnp.float32),
                            pltpu.VMEM((bq, rows, head_dim), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        cost_estimate=cost, name="multiserve_ragged_paged_attention",
        interpret=pltpu.InterpretParams() if interpret else False)
    out = call(jnp.asarray(layer, jnp.int32).reshape(1),
               jnp.asarray(terms.window, jnp.int32).reshape(1), pos, seq,
               page_table.astype(jnp.int32).reshape(-1), q_win, sink_win, k_pool, v_pool)
    out = out[:num_tokens].reshape(num_tokens, slots * group, head_dim)
    return out[:, :num_heads]
