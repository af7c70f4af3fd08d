"""Paged attention on accelerators, by Pallas kernels that read K/V from the pages in
place, prefill and decode tokens in one call.

Kernels (chosen by the invariance plan, `AttentionPlan.kernel`; calibration.py):
- "pallas_gpu": for a plain layer `jax.experimental.pallas.ops.gpu.paged_attention` (JAX's
  Pallas Triton decode kernel, called as a library with its block sizes PINNED here), for
  a layer with any attention term our Triton kernel (layers/attention_gpu.py: the same
  layout and pinned blocks, plus the window's lower bound, sinks, soft cap and scale; JAX's
  kernel has no lower bound on a token's keys and no sink); one query token per kernel
  sequence, on the "heads" pool (kv_pool.py) of the layer: q [B, Hq, D], pages
  [Hkv, P, page, D], a page table [B, pages] and lengths [B];
- "pallas_tpu": our own ragged paged attention kernel (layers/attention_tpu.py, Mosaic) on
  the TPU's "lanes" pool, read where it lies: the whole pool, no layer sliced or copied;
  it computes every attention term (score scale, sliding window, sinks, soft cap), as
  the GPU path does.
`AttentionPlan.interpret` runs either in Pallas interpret mode (tests on the CPU); the
environment variable MULTISERVE_ATTENTION_KERNEL (`FORCE_ENV`) makes the calibration
choose one on any platform, interpreted off its own.

The GPU call (`paged_attention_pallas`): every new token t becomes its own kernel sequence,
with its request's page-table row `page_table[token_seq[t]]` and length `positions[t] +
1`. The new tokens' K/V are already in the pool, so token t attends exactly to its keys at
positions <= positions[t] (causal, for decode rows and prefill chunks alike). The TPU
kernel takes the step whole (attention_tpu.py: each key block read once per query block).

Batch invariance, by construction: a token's result is computed by its own kernel
programs (GPU: one batch index of the kernel's grid; TPU: its own products with each of
its key blocks) over its own pages, in a fixed page order, with block sizes and the split
size PINNED (functions of the page size and of the page-table width, both fixed for an
engine; never of the token count). Which other tokens share the step changes only the
extent of the grid, never a token's reduction. The GPU kernel's final combination of its
key splits is an XLA reduction over the split axis of each row alone; empty splits (past
the length) contribute exact zeros.

On several devices (`tp`) the kernel runs in a `shard_map` (the compiler never partitions
a Mosaic or Triton call): each device over its own heads and its own heads of the pool
where attention is split, else every device over all of them.

Costs and limits (GPU):
- Prefill: a chunk of n tokens of one request reads that request's pages n times (each token
  alone, up to its own length): about n^2/2 key reads. Decode rows pay nothing.
- Layout: the kernel wants one layer as [KV, P, page, hd]: the "heads" pool's layer slice,
  reshaped (no transpose); as a kernel operand that slice is a copy of the layer.
- Block tables are padded with page 0 (the garbage page) to a multiple of the pinned split /
  compute block; those keys lie past every length and are masked.
- Numerics: q is scaled in float32 (1/sqrt(hd), as the XLA formulation does). The GPU kernel
  computes in the pool's dtype for q and its split partials (bfloat16 pool: q rounded to
  bfloat16), and its products take the default precision of `pl.dot` (on a GPU, float32
  operands may run as TF32: interpret mode on the CPU does not show that).
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms, first_key
from multiserve.model.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from multiserve.model.tensor_parallel import TensorParallel

AXIS = "tensor"  # the mesh's one axis (model/sharding.py)

PALLAS_KERNELS = ("pallas_gpu", "pallas_tpu")
KERNEL_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}  # where it runs compiled
# Tests: force a Pallas kernel as the attention candidate on any platform (interpreted
# where it was not made for the platform); part of the plan's cache key (store.py).
FORCE_ENV = "MULTISERVE_ATTENTION_KERNEL"
# Pinned block sizes of the GPU kernel, in tokens: a compute block is one online-softmax
# update; a split is one GPU program's share of a token's keys.
COMPUTE_BLOCK_TOKENS = 64
SPLIT_TOKENS = 512
GPU_BLOCK_H = 16  # the GPU kernel's query-head block (a multiple of 16 it requires)


def forced_kernel() -> str | None:
    """The Pallas kernel FORCE_ENV names, or None (unset or empty)."""
    name = os.environ.get(FORCE_ENV, "")
    if not name:
        return None
    if name not in PALLAS_KERNELS:
        raise ValueError(f"{FORCE_ENV}={name!r}: not one of {PALLAS_KERNELS}")
    return name


def pinned_blocks(page_size: int) -> tuple[int, int]:
    """(pages per compute block, pages per GPU split) for pages of `page_size` tokens."""
    per_block = max(1, COMPUTE_BLOCK_TOKENS // page_size)
    return per_block, max(per_block, SPLIT_TOKENS // page_size // per_block * per_block)


def _padded_table(rows: jax.Array, multiple: int) -> jax.Array:
    """Page-table rows padded with page 0 to a width that is a multiple of `multiple`."""
    extra = -rows.shape[1] % multiple
    return jnp.pad(rows, ((0, 0), (0, extra))) if extra else rows


def _layer_pages(pool: jax.Array, layer: int | jax.Array, page_size: int) -> jax.Array:
    """One layer of the pool [L, KV, slots, hd] as the kernels' pages [KV, P, page, hd]."""
    _, kv_heads, slots, head_dim = pool.shape
    one = jax.lax.dynamic_index_in_dim(pool, layer, axis=0, keepdims=False)
    return one.reshape(kv_heads, slots // page_size, page_size, head_dim)


def paged_attention_pallas(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           layer: int | jax.Array, batch: ForwardBatch, *, page_size: int,
                           kernel: str, interpret: bool, tp: TensorParallel | None = None,
                           kv_heads: int | None = None,
                           terms: AttentionTerms = PLAIN_ATTENTION) -> jax.Array:
    """q [T, H, hd] (already rotated) -> attention output [T, H, hd] in q's dtype, by the
    Pallas kernel `kernel` (module docstring). On several devices (`tp`) the kernel runs
    in a `shard_map` (a Mosaic or Triton call is never partitioned by the compiler): each
    device over its own heads and its own heads of the pool where attention is split,
    else every device over all of them (the same values everywhere). `kv_heads`: the
    model's KV heads (the TPU kernel's "lanes" pool does not say: its rows may be
    padded). `terms`: the layer's attention terms (every kernel computes every one)."""
    if tp is not None and tp.attention_split and kv_heads is not None:
        kv_heads //= tp.size  # each device's own
    call = partial(_kernel_call, page_size=page_size, kernel=kernel, interpret=interpret,
                   kv_heads=kv_heads, scale=terms.scale, softcap=terms.softcap,
                   plain=terms.plain and terms.scale <= 0)
    layer_ids = jnp.asarray(layer, jnp.int32)
    window = jnp.asarray(terms.window, jnp.int32)
    # the sinks of the heads (a row per head; none: an empty row the kernel never reads)
    sinks = (jnp.zeros((q.shape[1], 0), jnp.float32) if terms.sinks is None
             else terms.sinks.astype(jnp.float32).reshape(-1, 1))
    args = (q, k_pool, v_pool, layer_ids, window, sinks, batch.positions, batch.token_seq,
            batch.page_table)
    if tp is None:
        return call(*args)
    heads = P(None, AXIS, None) if tp.attention_split else P()
    head_rows = P(AXIS, None) if tp.attention_split else P()
    lanes = kernel == "pallas_tpu"  # the "lanes" pool [L, slots, KV * hd] (kv_pool.py)
    pool = (P() if not tp.attention_split
            else P(None, None, AXIS) if lanes else P(None, AXIS, None, None))
    return jax.shard_map(call, mesh=tp.mesh,
                         in_specs=(heads, pool, pool, P(), P(), head_rows, P(), P(), P()),
                         out_specs=heads, check_vma=False)(*args)


def _kernel_call(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                 window: jax.Array, sinks: jax.Array, positions: jax.Array,
                 token_seq: jax.Array, page_table: jax.Array, *, page_size: int, kernel: str,
                 interpret: bool, kv_heads: int | None, scale: float,
                 softcap: float, plain: bool) -> jax.Array:
    """`paged_attention_pallas` on one device's heads (`sinks` [its heads, 1], or
    [heads, 0]: none; `plain`: the layer has no term, JAX's library kernel serves it on a
    GPU)."""
    if kernel == "pallas_gpu":
        k_pages = _layer_pages(k_pool, layer, page_size)
        v_pages = _layer_pages(v_pool, layer, page_size)
        rows = page_table[token_seq]  # [T, max_pages]: each token's own table
        lengths = (positions + 1).astype(jnp.int32)
        per_block, per_split = pinned_blocks(page_size)
        table = _padded_table(rows, per_split)
        if not plain:  # our kernel (attention_gpu.py): every term
            from multiserve.model.layers.attention_gpu import ragged_attention_gpu

            return ragged_attention_gpu(
                q, k_pages, v_pages, table, lengths, first_key(positions, window),
                sinks[:, 0] if sinks.shape[1] else None,
                scale=scale if scale > 0 else float(q.shape[2]) ** -0.5, softcap=softcap,
                per_block=per_block, per_split=per_split, interpret=interpret)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        qs = q.astype(jnp.float32) * (1.0 / float(q.shape[2]) ** 0.5)
        out = paged_attention(qs.astype(k_pages.dtype), k_pages, v_pages, table, lengths,
                              block_h=GPU_BLOCK_H, pages_per_compute_block=per_block,
                              k_splits=table.shape[1] // per_split, interpret=interpret)
    elif kernel == "pallas_tpu":
        from multiserve.model.layers.attention_tpu import ragged_attention_tpu

        assert kv_heads is not None, "the TPU kernel needs the model's KV head count"
        terms = AttentionTerms(window=window, scale=scale, softcap=softcap,
                               sinks=sinks[:, 0] if sinks.shape[1] else None)
        return ragged_attention_tpu(q, k_pool, v_pool, layer, positions, token_seq,
                                    page_table, page_size=page_size, kv_heads=kv_heads,
                                    terms=terms, interpret=interpret)
    else:
        raise ValueError(f"not a Pallas attention kernel: {kernel!r} (one of {PALLAS_KERNELS})")
    return out.astype(q.dtype)
