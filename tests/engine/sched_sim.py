"""A model-free driver for the scheduling part (scheduler + prefix cache + page allocator):
the host bookkeeping EngineCore does around a step, with a made-up token function in place
of the device. Used by the unit tests that need no model (and no jax).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from multiserve.config import EngineConfig
from multiserve.engine.sched.page_allocator import PageAllocator
from multiserve.engine.sched.prefix_cache import PrefixCache
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.scheduler import Scheduler
from multiserve.types import SamplingParams

PAGE = 4


def fake_token(fill_ids: Sequence[int]) -> int:
    """The 'model': the next token is a function of the whole sequence so far, so any
    recomputation (retract, prefix hit, chunking) must reproduce the same tokens."""
    h = 17
    for t in fill_ids:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % 97


class Sim:
    """One scheduler over `num_pages` pages of PAGE tokens (page 0 reserved); `kv_window`:
    the model's (every layer slides by it: pages behind it are dropped)."""

    def __init__(self, num_pages: int = 17, *, max_context: int = 256, max_tokens: int = 16,
                 max_rows: int = 8, cache: bool = True, kv_window: int = 0,
                 **cfg: Any) -> None:
        self.cfg = EngineConfig(page_size=PAGE, chunked_prefill_size=cfg.pop(
            "chunked_prefill_size", max_tokens), max_running_requests=cfg.pop(
            "max_running_requests", max_rows), precompile_bs_paddings=(max_rows,),
            precompile_token_paddings=(max_tokens,), disable_prefix_cache=not cache, **cfg)
        self.allocator = PageAllocator(num_pages, PAGE)
        self.cache = PrefixCache(self.allocator, PAGE, enabled=cache)
        self.sched = Scheduler(self.cfg, self.allocator, self.cache, max_context, max_tokens,
                               max_rows, kv_window=kv_window)
        self.finished: dict[str, Req] = {}

    def req(self, rid: str, prompt: Sequence[int], max_new: int = 4, index: int = 0) -> Req:
        return Req(rid, index, list(prompt), SamplingParams(max_new_tokens=max_new), 0,
                   lambda out: None)

    def add(self, *reqs: Req) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self) -> ScheduledBatch | None:
        """Schedule, launch, then read the step at once (no overlap), as EngineCore does."""
        batch = self.sched.schedule()
        if batch is None:
            return None
        assert batch.num_tokens <= self.sched.max_tokens_per_step
        assert batch.num_logit_rows <= self.sched.max_rows
        self.sched.launch(batch)
        for row in batch.rows:
            if not row.samples:
                continue
            req = row.req
            req.pending -= 1
            req.output_ids.append(fake_token(req.fill_ids[:row.end]))
            if len(req.output_ids) >= req.params.max_new_tokens:
                self.finish(req)
        self.sched.check_integrity()
        return batch

    def finish(self, req: Req) -> None:
        self.sched.finish(req, "length")
        self.finished[req.rid] = req

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_work():
            assert self.step() is not None, "work left but nothing schedulable"
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def outputs(self) -> dict[str, list[int]]:
        return {rid: r.output_ids for rid, r in sorted(self.finished.items())}

    def free_tokens(self) -> int:
        """KV tokens free or reclaimable (evictable cache pages)."""
        return (self.allocator.num_free + self.cache.num_evictable_pages) * PAGE


def expected(prompt: Sequence[int], max_new: int) -> list[int]:
    """What an uninterrupted run of one request produces."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        out.append(fake_token(seq))
        seq.append(out[-1])
    return out
