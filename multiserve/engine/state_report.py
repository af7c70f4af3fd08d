"""The engine's introspection: `internal_state(core)`, what get_internal_state answers.

The keys are sglang's where it has them (`waiting_queue_size`, `running_batch_size`,
`forward_ct_decode`, ...) plus ours (pause reasons, compile progress, the determinism
plan, weight version, memory released, admission bounds, and what the engine holds in
memory: memory_report.py). Tests assert on them: they are exact (docs/architecture.md §9).

Invariant: read only, on the engine thread (a snapshot between two steps).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from multiserve.engine.device.program_share import sharing_status
from multiserve.engine.memory_report import memory_report

if TYPE_CHECKING:
    from multiserve.engine.base.kv_sizing import PoolSize
    from multiserve.engine.core import EngineCore
    from multiserve.engine.device.runner import Runner


def step_info(runner: Runner) -> dict[str, Any]:
    """What the steps run on: dtype, warm-up seconds, the compiled buckets."""
    return {"dtype": str(runner.dtype), "compile_s": runner.warmup_seconds,
            "buckets": [(kind.value, size) for kind, size in runner.step_programs.buckets()]}


def internal_state(core: EngineCore, kv_pool: PoolSize | None = None) -> dict[str, Any]:
    """`kv_pool`: how the KV pool's size was chosen (engine/setup.py), for "memory"."""
    s = core.scheduler
    return {
        "engine_paused": core.pause_state.paused,
        "pause_reasons": core.pause_state.reasons,
        # a "wait" pause draining: admission is closed, the pause is set once they finish
        "pause_pending": "wait" if core.wait_pause is not None else None,
        "pause_pending_requests": (sum(not r.finished for r in core.wait_pause.live)
                                   if core.wait_pause is not None else 0),
        "waiting_queue_size": len(s.waiting),
        "running_batch_size": len(s.running),
        "running_rids": [f"{r.rid}" if r.params.n == 1 else f"{r.rid}#{r.index}"
                         for r in s.running],
        "waiting_rids": [f"{r.rid}" if r.params.n == 1 else f"{r.rid}#{r.index}"
                         for r in s.waiting],
        "available_kv_tokens": s.available_kv_tokens(),
        "initial_available_kv_tokens": core.initial_available,
        "evictable_kv_tokens": core.cache.num_evictable_pages * core.page_size,
        "tree_cache_size": core.cache.num_cached_pages * core.page_size,
        "req_to_token_pool_used": sum(1 for r in s.running if r.pages),
        "forward_ct_decode": core.forward_ct_decode,
        "forward_ct": core.forward_ct,
        # steps run as one fused program (forward, head and sampler; device/step_programs.py)
        "forward_ct_fused": core.runner.fused_steps,
        # dispatches that ran decode_steps_per_dispatch decode steps in one program
        "forward_ct_decode_steps": core.runner.decode_steps_dispatches,
        "forward_ct_multi": core.runner.decode_steps_dispatches,  # its deprecated name
        "loop_passes": core.loop_passes,
        # speculative decoding: sglang's server-args names, then the running totals
        "speculative_algorithm": (core.cfg.speculative_algorithm.upper()
                                  if core.cfg.speculative_algorithm else None),
        "speculative_num_draft_tokens": core.cfg.speculative_num_draft_tokens,
        "speculative_max_step_tokens": core.cfg.speculative_max_step_tokens,
        "spec_verify_ct": s.planner.spec_verify_ct,
        "spec_proposed_tokens": s.planner.spec_proposed_tokens,
        "spec_accepted_tokens": s.planner.spec_accepted_tokens,
        "empty_passes": core.empty_passes,
        "new_token_ratio": s.new_token_ratio,
        "cur_batch": core.in_flight is not None,
        "last_batch": core.last_batch is not None,
        "chunked_req": bool(s.chunked_reqs),
        "cache_miss_count": core.runner.step_programs.cache_miss_count,
        "compile": dataclasses.asdict(core.runner.programs.status()),
        "determinism": core.runner.determinism,
        "program_sharing": dataclasses.asdict(
            sharing_status(core.runner.devices[0].platform)),
        "dtype": str(core.runner.dtype),  # sglang's server-args name
        "dtype_choice": core.runner.dtype_choice.summary(),
        # the weights' 2 MiB pages (device/huge_pages.py); empty until its thread is done
        "huge_pages": {k: dataclasses.asdict(v) for k, v in core.runner.huge_page_advice.items()},
        "weight_version": core.weight_version,
        "memory_released": sorted(core.released_tags),
        "num_retractions": s.num_retractions,
        "page_size": core.page_size,
        "max_total_tokens": core.allocator.num_usable * core.page_size,
        "max_context_len": core.max_context,
        "max_queued_requests": core.admission.max_queued_requests,
        "max_queued_tokens": core.admission.max_queued_tokens,
        "overlap": core.overlap,
        "prefix_cache_hit_tokens": core.cache.hit_tokens,
        # the LoRA delta's form: "native" (the CPU kernel), "xla", or None without LoRA
        "lora_kernel": core.runner.lora_kernel,
        # what the engine holds: weights, KV pool, compiled programs (memory_report.py)
        "memory": memory_report(core.runner, kv_pool),
    }
