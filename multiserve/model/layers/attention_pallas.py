"""Paged attention on accelerators: JAX's shipped Pallas decode kernels, one query token per
kernel sequence, so prefill and decode tokens share one call.

Kernels (chosen by the invariance plan, `AttentionPlan.kernel`; calibration.py):
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (Pallas Triton);
- "pallas_tpu": `jax.experimental.pallas.ops.tpu.paged_attention` (Pallas Mosaic).
Both read K/V from the pages in place: q [B, Hq, D], pages [Hkv, P, page, D], a page table
[B, pages] and lengths [B]. `AttentionPlan.interpret` runs either in Pallas interpret mode
(tests on the CPU; the TPU one under `pltpu.force_tpu_interpret_mode`); the environment
variable MULTISERVE_ATTENTION_KERNEL (`FORCE_ENV`) makes the calibration choose one on any
platform, interpreted off its own.

The call (`paged_attention_pallas`): every new token t becomes its own kernel sequence, with
its request's page-table row `page_table[token_seq[t]]` and length `positions[t] + 1`. The
new tokens' K/V are already in the pool, so token t attends exactly to its keys at
positions <= positions[t] (causal, for decode rows and prefill chunks alike).

Batch invariance, by construction: a token's result is computed by its own kernel programs
(one batch index of the kernel's grid) over its own pages, in a fixed page order, with block
sizes and the split size PINNED here (functions of the page size and of the page-table
width, both fixed for an engine; never of the token count). Which other tokens share the
step changes only the batch extent of the grid, never a token's reduction. The GPU kernel's
final combination of its key splits is an XLA reduction over the split axis of each row
alone; empty splits (past the length) contribute exact zeros.

Costs and limits:
- Prefill: a chunk of n tokens of one request reads that request's pages n times (each token
  alone, up to its own length): about n^2/2 key reads where a ragged kernel would read each
  key block once per query block (the shipped TPU ragged kernel,
  `ops.tpu.ragged_paged_attention`, takes cu_q_lens and K/V interleaved on the head axis; on
  jax 0.10.2 it fails in interpret mode and looks its block sizes up from the TPU at trace
  time, by token count, so it is neither testable here nor pinned). Decode rows pay nothing.
- Layout, THE MAIN COST: the pool is [L, KV, slots, hd] (kv_pool.py); the kernels want one
  layer as [KV, P, page, hd]: the pool's layer slice, reshaped (no transpose). As a kernel
  operand that slice (static in the unrolled decoder, dynamic in the scanned one) is a
  copy: every layer copies its whole layer of the pool, so a step copies the whole pool
  (K and V), used pages or not, where the kernels alone read only the pages in use. A pool
  laid out KV-major per platform, [KV, L, slots, hd], viewed as [KV, L*P, page, hd] with
  page ids offset by layer * P, would let the kernels read it in place; not done here (the
  write, the XLA formulation's gathers and the pool's sharding assume the current layout).
- TPU, head_dim not a multiple of 128 (64 for SmolLM2 and the 1B shape): q and the layer's
  pages are zero-padded to 128 (the kernel's lowering needs it), so the layer copy above
  is twice as large and the kernel reads twice the bytes per key.
- Block tables are padded with page 0 (the garbage page) to a multiple of the pinned split /
  compute block; those keys lie past every length and are masked.
- Numerics: q is scaled in float32 (1/sqrt(hd), as the XLA formulation does). The GPU kernel
  computes in the pool's dtype for q and its split partials (bfloat16 pool: q rounded to
  bfloat16), and its products take the default precision of `pl.dot` (on a GPU, float32
  operands may run as TF32: interpret mode on the CPU does not show that); the TPU kernel
  casts K/V to bfloat16 inside (a float32 pool loses precision).
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from multiserve.model.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from multiserve.model.tensor_parallel import TensorParallel

AXIS = "tensor"  # the mesh's one axis (model/sharding.py)

PALLAS_KERNELS = ("pallas_gpu", "pallas_tpu")
KERNEL_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}  # where it runs compiled
# Tests: force a Pallas kernel as the attention candidate on any platform (interpreted
# where it was not made for the platform); part of the plan's cache key (store.py).
FORCE_ENV = "MULTISERVE_ATTENTION_KERNEL"
# Pinned block sizes, in tokens: a compute block is one online-softmax update of the GPU
# kernel and the TPU kernel; a split is one GPU program's share of a token's keys.
COMPUTE_BLOCK_TOKENS = 64
SPLIT_TOKENS = 512
GPU_BLOCK_H = 16  # the GPU kernel's query-head block (a multiple of 16 it requires)
# The TPU kernel lowers only for head_dim a multiple of this (its running max and sum are
# blocked like q): a smaller head dim is zero-padded up to it.
TPU_LANES = 128


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
                           kernel: str, interpret: bool,
                           tp: TensorParallel | None = None) -> jax.Array:
    """q [T, H, hd] (already rotated) -> attention output [T, H, hd] in q's dtype, by the
    Pallas kernel `kernel` (module docstring). On several devices (`tp`) the kernel runs
    in a `shard_map` (a Mosaic or Triton call is never partitioned by the compiler): each
    device over its own heads and its own heads of the pool where attention is split,
    else every device over all of them (the same values everywhere)."""
    call = partial(_kernel_call, page_size=page_size, kernel=kernel, interpret=interpret)
    layer_ids = jnp.asarray(layer, jnp.int32)
    if tp is None:
        return call(q, k_pool, v_pool, layer_ids, batch.positions, batch.token_seq,
                    batch.page_table)
    heads = P(None, AXIS, None) if tp.attention_split else P()
    pool = P(None, AXIS, None, None) if tp.attention_split else P()
    return jax.shard_map(call, mesh=tp.mesh,
                         in_specs=(heads, pool, pool, P(), P(), P(), P()),
                         out_specs=heads, check_vma=False)(
        q, k_pool, v_pool, layer_ids, batch.positions, batch.token_seq, batch.page_table)


def _kernel_call(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                 positions: jax.Array, token_seq: jax.Array, page_table: jax.Array, *,
                 page_size: int, kernel: str, interpret: bool) -> jax.Array:
    """`paged_attention_pallas` on one device's heads."""
    head_dim = q.shape[2]
    scale = 1.0 / float(head_dim) ** 0.5
    k_pages = _layer_pages(k_pool, layer, page_size)
    v_pages = _layer_pages(v_pool, layer, page_size)
    rows = page_table[token_seq]  # [T, max_pages]: each token's own table
    lengths = (positions + 1).astype(jnp.int32)
    per_block, per_split = pinned_blocks(page_size)
    qs = q.astype(jnp.float32) * scale
    if kernel == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        table = _padded_table(rows, per_split)
        out = paged_attention(qs.astype(k_pages.dtype), k_pages, v_pages, table, lengths,
                              block_h=GPU_BLOCK_H, pages_per_compute_block=per_block,
                              k_splits=table.shape[1] // per_split, interpret=interpret)
    elif kernel == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        table = _padded_table(rows, per_block)
        lanes = -head_dim % TPU_LANES  # zero head dims: the same scores, zero outputs there
        if lanes:
            qs = jnp.pad(qs, ((0, 0), (0, 0), (0, lanes)))
            k_pages, v_pages = (jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, lanes)))
                                for p in (k_pages, v_pages))

        def call() -> jax.Array:
            return paged_attention(qs, k_pages, v_pages, lengths, table,
                                   pages_per_compute_block=per_block)[..., :head_dim]

        if interpret:
            with pltpu.force_tpu_interpret_mode():
                out = call()
        else:
            out = call()
    else:
        raise ValueError(f"not a Pallas attention kernel: {kernel!r} (one of {PALLAS_KERNELS})")
    return out.astype(q.dtype)
