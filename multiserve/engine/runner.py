"""Runner: the jitted, bucketed forward + sample step of one engine, on its devices.

Owns the device state of one engine: sharded params, the KV pool (donated to every
step, updated in place), and the device buffer of the last step's sampled ids.

Invariants:
- Shapes come only from (T, B) buckets in the config: T tokens, B sequence rows
  (= logits rows). Every bucket is compiled by `warmup()`; `cache_miss_count` counts
  traces after warm-up, so a test can assert zero recompiles.
- `run()` never waits for the device: it returns device arrays. The next step reads
  the previous step's sampled ids from `self._prev_ids` on device (overlap scheduling:
  no host round trip between consecutive decode steps).
- The jitted function is created per Runner (closure over this engine's config and
  shardings); nothing device-resident is cached at module level.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import EngineConfig, ModelConfig
from multiserve.engine import sampling, sampling_host
from multiserve.engine.batch_arrays import StepArrays
from multiserve.model.forward_batch import ForwardBatch
from multiserve.model.kv_pool import KVPool, make_kv_pool
from multiserve.model.llama import forward
from multiserve.model.sharding import kv_pool_sharding, make_mesh, shard_params


def cast_params(params: Any, dtype: Any) -> Any:
    """Host (numpy) params cast to the engine's compute dtype (norms included)."""
    return jax.tree.map(lambda a: np.asarray(a).astype(np.dtype(dtype), copy=False), params)


@dataclass
class StepOutput:
    """Device arrays of one launched step (host reads them later)."""

    next_ids: jax.Array  # [max_rows] int32 (rows >= B are junk)
    sample: Any  # sampling.SampleOutput (device)
    num_rows: int
    wants_logprobs: bool


class Runner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, params_host: Any,
                 devices: Sequence[jax.Device], num_pages: int, dtype: Any) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.dtype = dtype
        self.devices = list(devices)
        self.mesh = make_mesh(self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.num_pages = num_pages
        self.max_rows = max(cfg.precompile_bs_paddings)
        self.params = shard_params(cast_params(params_host, dtype), model_cfg, self.mesh)
        self._kv_sharding = kv_pool_sharding(model_cfg, self.mesh)
        self.kv: KVPool | None = make_kv_pool(model_cfg, num_pages, cfg.page_size, dtype,
                                              sharding=self._kv_sharding)
        self._prev_ids = jax.device_put(np.zeros(self.max_rows, np.int32), self.replicated)
        self._zero_cache: dict[int, Any] = {}
        self.trace_count = 0
        self.warmup_trace_count: int | None = None
        self._lock = threading.Lock()
        self._step_fn = jax.jit(self._step_impl, donate_argnums=(1,))

    # ---- the traced step -----------------------------------------------------------
    def _step_impl(self, params: Any, kv: KVPool, prev_ids: jax.Array, arrays: dict,
                   sb: Any) -> tuple[jax.Array, Any, KVPool]:
        self.trace_count += 1  # Python side effect: runs once per trace (= per compile)
        from_prev = arrays["from_prev"]
        ids = jnp.where(from_prev >= 0, prev_ids[jnp.maximum(from_prev, 0)],
                        arrays["input_ids"])
        fb = ForwardBatch(input_ids=ids, positions=arrays["positions"],
                          token_seq=arrays["token_seq"], out_slots=arrays["out_slots"],
                          page_table=arrays["page_table"], seq_lens=arrays["seq_lens"],
                          logit_rows=arrays["logit_rows"])
        logits, kv = forward(params, kv, fb, self.model_cfg, page_size=self.cfg.page_size,
                             attn_block_size=self.cfg.attention_block_size)
        # Penalties count output tokens; the host does not know the ids still on device:
        # add them here for rows whose input came from the previous step.
        row_prev = from_prev[arrays["logit_rows"]]
        prev_tok = ids[arrays["logit_rows"]]
        sb = _add_inflight_tokens(sb, prev_tok, row_prev >= 0)
        out = sampling.sample(logits, sb)
        b = logits.shape[0]
        next_ids = jnp.zeros(self.max_rows, jnp.int32).at[:b].set(out.next_ids)
        return next_ids, out, kv

    # ---- buckets / warm-up ---------------------------------------------------------
    def buckets(self) -> list[tuple[int, int]]:
        return [(t, b) for t, b in itertools.product(self.cfg.precompile_token_paddings,
                                                     self.cfg.precompile_bs_paddings) if b <= t]

    def bucket_for(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        for t, b in self.buckets():
            if t >= num_tokens and b >= num_rows:
                return t, b
        raise ValueError(f"no bucket for {num_tokens} tokens / {num_rows} rows")

    def warmup(self, max_pages: int, progress: Any = None) -> None:
        for t, b in self.buckets():
            arrays = StepArrays(
                input_ids=np.zeros(t, np.int32), from_prev=np.full(t, -1, np.int32),
                positions=np.zeros(t, np.int32), token_seq=np.zeros(t, np.int32),
                out_slots=np.zeros(t, np.int32),
                page_table=np.zeros((b, max_pages), np.int32),
                seq_lens=np.zeros(b, np.int32), logit_rows=np.zeros(b, np.int32),
                prompt_rows=[])
            sb = self.sampling_batch([], b)
            out = self.run(arrays, sb, wants_logprobs=False)
            jax.block_until_ready(out.next_ids)
            if progress is not None:
                progress(t, b)
        self.warmup_trace_count = self.trace_count

    @property
    def cache_miss_count(self) -> int:
        if self.warmup_trace_count is None:
            return 0
        return self.trace_count - self.warmup_trace_count

    # ---- running -------------------------------------------------------------------
    def run(self, arrays: StepArrays, sb_host: Any, wants_logprobs: bool) -> StepOutput:
        assert self.kv is not None, "KV pool released: resume memory before running"
        host = {k: getattr(arrays, k) for k in (
            "input_ids", "from_prev", "positions", "token_seq", "out_slots", "page_table",
            "seq_lens", "logit_rows")}
        dev_arrays, sb = jax.device_put((host, sb_host), self.replicated)
        next_ids, out, self.kv = self._step_fn(self.params, self.kv, self._prev_ids,
                                               dev_arrays, sb)
        self._prev_ids = next_ids
        return StepOutput(next_ids=next_ids, sample=out, num_rows=arrays.seq_lens.shape[0],
                          wants_logprobs=wants_logprobs)

    def reset_prev_ids(self) -> None:
        self._prev_ids = jax.device_put(np.zeros(self.max_rows, np.int32), self.replicated)

    def drop_step_buffers(self) -> None:
        """Free the small per-step device buffers (memory release; see memory_release.py).
        `reset_prev_ids()` brings back the only one a step needs; zeros are re-made lazily."""
        buffers = [self._prev_ids, *(a for z in self._zero_cache.values() for a in z)]
        self._zero_cache.clear()
        self._prev_ids = None
        for a in buffers:
            if a is not None and not a.is_deleted():
                a.delete()

    def sampling_batch(self, rows: Sequence[sampling_host.RowSpec | None],
                       num_rows: int) -> sampling.SamplingBatch:
        """Host sampling inputs for one step; penalty-free steps reuse this engine's
        device-resident zero [B, V] arrays (a per-engine cache, never module-level)."""
        if num_rows not in self._zero_cache:
            zeros = sampling_host.penalty_zeros(num_rows, self.model_cfg.vocab_size)
            self._zero_cache[num_rows] = sampling_host.PenaltyZeros(
                *jax.device_put(tuple(zeros), self.replicated))
        return sampling_host.build_sampling_batch(rows, num_rows, self.model_cfg.vocab_size,
                                             zeros=self._zero_cache[num_rows])


def _add_inflight_tokens(sb: sampling.SamplingBatch, tokens: jax.Array,
                         mask: jax.Array) -> sampling.SamplingBatch:
    """Count, for penalties, the output token each row got from the previous step but
    the host has not read yet (its id only exists on device)."""

    def add(counts: jax.Array) -> jax.Array:
        rows = jnp.arange(counts.shape[0])
        return counts.at[rows, tokens].add(mask.astype(counts.dtype))

    counts = jax.lax.cond(sb.any_penalty, add, lambda c: c, sb.output_counts)
    return sb.replace(output_counts=counts)
