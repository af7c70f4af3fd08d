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
QUERY_CHUNK = 64  # rows per attention chunk; T is a multiple of it (else one chunk of T)


def _chunk_attention(q: jax.Array, pos: jax.Array, seq: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array, *,
                     page_size: int, block_size: int) -> jax.Array:
    """One chunk: q [C, KV, G, hd] f32 (pre-scaled), pos/seq [C] -> out [C, KV, G, hd] f32."""
    c, kv_heads, group, head_dim = q.shape
    max_pages = page_table.shape[1]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    rows = page_table[seq]  # [C, max_pages]
    num_blocks = jnp.max(pos) // block_size + 1

    def body(j, carry):
        m, l, acc = carry  # [C,KV,G], [C,KV,G], [C,KV,G,hd]
        key_pos = j * block_size + offsets  # [bs]
        page_idx = jnp.minimum(key_pos // page_size, max_pages - 1)  # clamped keys are masked
        slots = rows[:, page_idx] * page_size + key_pos % page_size  # [C, bs]
        k = k_pool[layer, slots].astype(jnp.float32)  # [C, bs, KV, hd]
        v = v_pool[layer, slots].astype(jnp.float32)
        s = jnp.einsum("ckgd,cikd->ckgi", q, k)  # [C, KV, G, bs]
        s = jnp.where(key_pos[None, None, None, :] > pos[:, None, None, None], MASK_VALUE, s)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_new = l * alpha + jnp.sum(p, axis=-1)
        acc_new = acc * alpha[..., None] + jnp.einsum("ckgi,cikd->ckgd", p, v)
        return m_new, l_new, acc_new

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

    def one(args):
        qc, pc, sc = args
        return _chunk_attention(qc, pc, sc, k_pool, v_pool, layer, batch.page_table,
                                page_size=page_size, block_size=block_size)

    out = jax.lax.map(one, (qf.reshape(n, chunk, kv_heads, group, head_dim),
                            batch.positions.reshape(n, chunk), batch.token_seq.reshape(n, chunk)))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
