"""Paged, batch-invariant causal attention: the ONE function a TPU kernel may replace.

`paged_attention` computes, for every new token t of sequence s = token_seq[t] at position
p = positions[t], softmax(q_t . K_s / sqrt(head_dim)) V_s over the keys at positions <= p,
reading K/V from the paged pool (the new tokens' K/V are already written there).

Batch invariance (the engine's greedy determinism rests on it), by construction:
- Tokens are processed in fixed chunks of QUERY_CHUNK rows (`lax.map`), so the attention
  arithmetic always runs on the same shapes whatever the batch size T.
- Keys are visited in blocks of `block_size` consecutive positions aligned to position 0
  (block j = [j*bs, (j+1)*bs)), for j < nb, a TRACED loop bound (no recompiles per length):
  nb = max over the chunk of p // bs + 1.
- Each block is an online-softmax update in fp32; keys past p are masked with a finite
  -1e30, so a block entirely past p is an exact identity update (alpha == 1, p == 0; the
  pool is zero-initialised and holds only finite values). Hence a token's result does not
  depend on how many blocks its chunk needed.
- Every contraction is per token (batched over tokens, never across tokens), so a token's
  result is bitwise independent of the other tokens in its chunk and of its row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multiserve.model.forward_batch import ForwardBatch

MASK_VALUE = -1e30  # finite: exp(MASK_VALUE - m) == 0 exactly, never inf - inf
QUERY_CHUNK = 16  # rows per attention chunk; T is a multiple of it (else one chunk of T)


def _gather_block(k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, rows: jax.Array,
                  j: jax.Array, *, page_size: int,
                  block_size: int) -> tuple[jax.Array, jax.Array]:
    """K and V of key block j for each chunk row's sequence: [C, KV, bs, hd] float32.

    Whole pages are gathered when a block spans pages (contiguous copies), single slots
    otherwise. Page indices past the page table are clamped; those keys are masked anyway.
    """
    c, max_pages = rows.shape
    num_layers, num_slots, kv_heads, head_dim = k_pool.shape
    if block_size >= page_size:
        assert block_size % page_size == 0, (block_size, page_size)
        per_block = block_size // page_size
        page_idx = jnp.minimum(j * per_block + jnp.arange(per_block), max_pages - 1)
        pages = rows[:, page_idx]  # [C, per_block]
        shape = (num_layers, num_slots // page_size, page_size, kv_heads, head_dim)

        def take(pool: jax.Array) -> jax.Array:
            blk = pool.reshape(shape)[layer, pages]  # [C, per_block, ps, KV, hd]
            return blk.reshape(c, block_size, kv_heads, head_dim)
    else:
        key_pos = j * block_size + jnp.arange(block_size)
        page = rows[:, jnp.minimum(key_pos // page_size, max_pages - 1)]  # [C, bs]
        slots = page * page_size + key_pos % page_size

        def take(pool: jax.Array) -> jax.Array:
            return pool[layer, slots]  # [C, bs, KV, hd]

    return (jnp.swapaxes(take(k_pool), 1, 2).astype(jnp.float32),
            jnp.swapaxes(take(v_pool), 1, 2).astype(jnp.float32))


def _chunk_attention(q: jax.Array, pos: jax.Array, seq: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array, *,
                     page_size: int, block_size: int) -> jax.Array:
    """One chunk: q [C, KV, G, hd] f32 (pre-scaled), pos/seq [C] -> out [C, KV, G, hd] f32."""
    c, kv_heads, group, head_dim = q.shape
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    rows = page_table[seq]  # [C, max_pages]
    num_blocks = jnp.max(pos) // block_size + 1

    def body(j, carry):
        m, l, acc = carry  # [C,KV,G], [C,KV,G], [C,KV,G,hd]
        key_pos = j * block_size + offsets  # [bs]
        k, v = _gather_block(k_pool, v_pool, layer, rows, j, page_size=page_size,
                             block_size=block_size)  # [C, KV, bs, hd] f32
        s = jax.lax.dot_general(k, q, (((3,), (3,)), ((0, 1), (0, 1))))  # [C, KV, bs, G]
        s = jnp.where(key_pos[None, None, :, None] > pos[:, None, None, None], MASK_VALUE, s)
        m_new = jnp.maximum(m, jnp.max(s, axis=2))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, :, None, :])
        l_new = l * alpha + jnp.sum(p, axis=2)
        pv = jax.lax.dot_general(p, v, (((2,), (2,)), ((0, 1), (0, 1))))  # [C, KV, G, hd]
        return m_new, l_new, acc * alpha[..., None] + pv

    shape = (c, kv_heads, group)
    init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return acc / l[..., None]


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                    batch: ForwardBatch, *, page_size: int, block_size: int) -> jax.Array:
    """q [T, H, hd] (already rotated) -> attention output [T, H, hd] in q's dtype.

    k_pool/v_pool are the whole pool [L, slots, KV, hd]; `layer` (traced scalar) selects the
    layer inside the gathers, so no per-layer copy of the pool is made.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    group = num_heads // kv_heads
    scale = 1.0 / float(head_dim) ** 0.5
    qf = (q.astype(jnp.float32) * scale).reshape(num_tokens, kv_heads, group, head_dim)
    chunk = QUERY_CHUNK if num_tokens % QUERY_CHUNK == 0 else num_tokens
    n = num_tokens // chunk
    # Rows sorted by position: each chunk loops only over the key blocks its own longest
    # row needs, so short sequences stop paying for long ones. A row's result does not
    # depend on its chunk (blocks past its position are exact identity updates).
    order = jnp.argsort(batch.positions, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(num_tokens, dtype=order.dtype))

    def one(args):
        qc, pc, sc = args
        return _chunk_attention(qc, pc, sc, k_pool, v_pool, layer, batch.page_table,
                                page_size=page_size, block_size=block_size)

    out = jax.lax.map(one, (qf[order].reshape(n, chunk, kv_heads, group, head_dim),
                            batch.positions[order].reshape(n, chunk),
                            batch.token_seq[order].reshape(n, chunk)))
    out = out.reshape(num_tokens, kv_heads, group, head_dim)[inverse]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
