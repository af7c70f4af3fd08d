"""Our Pallas GPU (Triton) paged attention kernel for layers with attention terms (a sliding
window, sinks, a soft cap, a score scale: attention_terms.py), which JAX's library GPU
kernel does not compute (it has no lower bound on a token's keys and no sink). Plain
layers keep the library kernel (attention_pallas.py); this one serves every layer of a
model that has any term.

Layout, as the library kernel's: every new token t is its own kernel sequence, with its
request's page-table row, its length `positions[t] + 1` and its window's first position
`lo[t]` (0: a global layer); one layer's pages [KV, P, page, hd] from the "heads" pool;
the token's query heads of one KV head as one [16, hd] block (GQA group padded to 16, or
to the next power of two above it).

Grid (token, KV head, split): a split is a FIXED range of `per_split` page-table entries;
its program reads the pages of that range that hold keys in [lo, length), in compute
blocks of `per_block` pages starting at the window's first page (so a window layer reads
no page wholly before its window), masks the keys outside [lo, min(length, split end)),
and leaves its online-softmax partials (o [16, hd], max m, sum l, all float32). An XLA
reduction over the split axis of each token alone combines them, the sink logits (one per
head: a term of the denominator with no value) included.

Batch invariance, by construction: a token's programs depend on its own query, its own
pages, its position and window, and the page-table width (fixed for an engine: it fixes
the split count); never on which tokens share the step. Numerics: q is scaled in float32
and rounded to the pool's dtype (as the library kernel's plain path does), products
accumulate in float32 (`plgpu.dot`: on a GPU, float32 operands may run as TF32; interpret
mode on the CPU does not show that), the soft cap applies to the scaled scores.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK_H = 16  # query rows of a program (Triton's dot wants >= 16 rows)
# A masked score: finite, so that exp(mask - max) is an exact 0 and never NaN; below any
# score (the soft cap bounds them; uncapped scores of real models stay far from it).
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(q_ref, k_ref, v_ref, row_ref, length_ref, lo_ref,  # type: ignore[no-untyped-def]
            o_ref, m_ref, l_ref, *, per_block: int, per_split: int, softcap: float) -> None:
    """One (token, KV head, split) program: the partials of its split's keys."""
    split = pl.program_id(2)
    page = k_ref.shape[-2]
    head_dim = q_ref.shape[-1]
    block_k = per_block * page
    length = length_ref[0]
    lo = lo_ref[0]
    split_start = split * per_split
    first_page = jnp.maximum(split_start, lo // page)
    end_page = jnp.minimum(split_start + per_split, pl.cdiv(length, page))
    hi = jnp.minimum(length, end_page * page)  # keys of the next split are its own
    blocks = jnp.maximum(pl.cdiv(end_page - first_page, per_block), 0)
    q = q_ref[...]

    def body(b, carry):  # type: ignore[no-untyped-def]
        o, m, l = carry
        start = first_page + b * per_block
        pages = row_ref[pl.ds(start, per_block)]
        k = k_ref[pages].reshape(block_k, head_dim)
        v = v_ref[pages].reshape(block_k, head_dim)
        scores = plgpu.dot(q, k, trans_b=True)  # [16, block_k], float32
        if softcap > 0:
            scores = jnp.tanh(scores / softcap) * softcap
        pos = start * page + jnp.arange(block_k)
        keep = (pos >= lo) & (pos < hi)
        scores = jnp.where(lax.broadcast_in_dim(keep, scores.shape, (1,)), scores, MASK)
        m_next = jnp.maximum(m, scores.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[:, None])
        l_next = correction * l + p.sum(axis=-1)
        o_next = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v)
        return o_next, m_next, l_next

    rows = q.shape[0]
    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(0, blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def ragged_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         rows: jax.Array, lengths: jax.Array, lo: jax.Array,
                         sinks: jax.Array | None, *, scale: float, softcap: float,
                         per_block: int, per_split: int, interpret: bool) -> jax.Array:
    """q [T, H, hd] (rotated, unscaled); k_pages / v_pages [KV, P, page, hd]; rows [T, W]
    each token's page-table row, W a multiple of `per_split` (page 0 past the request's
    pages); lengths [T] (position + 1); lo [T] the first key position each token sees;
    sinks [H] float32 or None -> the attention output [T, H, hd] in q's dtype."""
    tokens, heads, head_dim = q.shape
    kv_heads, _, page, _ = k_pages.shape
    group = heads // kv_heads
    width = rows.shape[1]
    assert width % per_split == 0 and per_split % per_block == 0, (width, per_split)
    block_h = max(MIN_BLOCK_H, 1 << (group - 1).bit_length())  # a power of two, >= group
    splits = width // per_split
    qs = (q.astype(jnp.float32) * scale).astype(k_pages.dtype)
    qs = qs.reshape(tokens, kv_heads, group, head_dim)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    # a block starting in a split's last pages reads up to per_block - 1 entries past the
    # row (masked keys): page 0, the garbage page, is there
    rows = jnp.pad(rows.astype(jnp.int32), ((0, 0), (0, per_block)))
    pages_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda t, h, s: (h, 0, 0, 0))
    per_token = pl.BlockSpec((1,), lambda t, h, s: (t,))
    o, m, l = pl.pallas_call(
        partial(_kernel, per_block=per_block, per_split=per_split, softcap=float(softcap)),
        grid=(tokens, kv_heads, splits),
        in_specs=[pl.BlockSpec((None, None, block_h, head_dim), lambda t, h, s: (t, h, 0, 0)),
                  pages_spec, pages_spec,
                  pl.BlockSpec((None, width + per_block), lambda t, h, s: (t, 0)),
                  per_token, per_token],
        out_specs=[pl.BlockSpec((None, None, None, block_h, head_dim),
                                lambda t, h, s: (t, s, h, 0, 0)),
                   pl.BlockSpec((None, None, None, block_h), lambda t, h, s: (t, s, h, 0)),
                   pl.BlockSpec((None, None, None, block_h), lambda t, h, s: (t, s, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, splits, kv_heads, block_h, head_dim),
                                        jnp.float32),
                   jax.ShapeDtypeStruct((tokens, splits, kv_heads, block_h), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, splits, kv_heads, block_h), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="multiserve_ragged_attention_gpu",
    )(qs, k_pages, v_pages, rows, lengths.astype(jnp.int32), lo.astype(jnp.int32))
    o, m, l = o[:, :, :, :group], m[:, :, :, :group], l[:, :, :, :group]
    top = m.max(axis=1)  # [T, KV, group]: each token's own splits
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, group)
        top = jnp.maximum(top, sink[None])
    correction = jnp.exp(m - top[:, None])  # an empty split: exp(MASK - top) == 0
    total = (l * correction).sum(axis=1)
    if sinks is not None:
        total = total + jnp.exp(sink[None] - top)
    out = (o * correction[..., None]).sum(axis=1) / total[..., None]
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)
