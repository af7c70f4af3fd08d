"""A step's prefill rows (a part of the Scheduler, engine/sched/scheduler.py), under the
token budget and the logits rows left: first the next chunk of every Req mid-prefill, then
admissions from `waiting` in order (`_admit`: its prefix-cache hit, its first chunk, the
pages it needs now and later against those free or evictable, the decode tokens running
Reqs are still expected to need); a chunk that needs prompt logprobs takes a logits row
per token. Plain Python (never imports jax).
"""

from __future__ import annotations

from multiserve.engine.sched.batch import BatchRow
from multiserve.engine.sched.page_allocator import pages_needed
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.row_plan import logit_rows_of
from multiserve.engine.sched.state import SchedulerState
from multiserve.types import RequestStatus


class PrefillRows(SchedulerState):
    def _prefill_rows(self, budget: int, max_new_rows: int) -> list[BatchRow]:
        """Prefill chunks under the token budget. `max_new_rows` counts logits rows: one
        per sequence, plus one per prompt position whose logprob is wanted."""
        rows: list[BatchRow] = []
        # 1. continue chunked prefills (already admitted)
        for r in self.running:
            if budget <= 0 or max_new_rows <= 0:
                return rows
            if r.in_prefill:
                row = self._chunk_row(r, self._capped(r, budget, max_new_rows))
                if row is None:
                    return rows
                rows.append(row)
                budget -= row.end - row.start
                max_new_rows -= logit_rows_of(row)
        # 2. admit from waiting, in order
        admitted: list[Req] = []
        for req in list(self.waiting):
            if budget <= 0 or max_new_rows <= 0:
                break
            if len(self.running) >= self.cfg.max_running_requests:
                break
            if req.pending > 0:
                continue  # its last token is still on the device
            if not self._admissible(req):
                continue  # arrived after a "wait" pause began: it waits for continue
            if req.leader is not None and not self._leader_ready(req.leader):
                continue
            chunk_budget = self._capped(req, budget, max_new_rows)
            row = self._admit(req, chunk_budget) if chunk_budget > 0 else None
            if row is None:
                break  # out of KV or rows: keep FIFO order, try again next step
            admitted.append(req)
            rows.append(row)
            budget -= row.end - row.start
            max_new_rows -= logit_rows_of(row)
        for req in admitted:
            self.waiting.remove(req)
        return rows

    @staticmethod
    def _capped(req: Req, budget: int, rows_left: int) -> int:
        """A chunk that needs prompt logprobs takes one logits row per token."""
        return min(budget, rows_left - 1) if req.needs_prompt_logprobs else budget

    @staticmethod
    def _leader_ready(leader: Req) -> bool:
        return leader.finished or leader.admitted_once and not leader.in_prefill

    def _admit(self, req: Req, budget: int) -> BatchRow | None:
        fill = req.fill_ids
        total = len(fill)
        # prompt logprobs need the logits of every prompt position: no prefix reuse
        hit_pages = ([] if req.needs_prompt_logprobs
                     else self.cache.match(fill, total - 1, self._cache_root(req)))
        hit = len(hit_pages) * self.page_size
        chunk = min(budget, total - hit)
        new_pages = pages_needed(hit + chunk, self.page_size) - len(hit_pages)
        future = pages_needed(total - hit - chunk, self.page_size)
        reserve = -(-self._reserved_tokens(req) // self.page_size)
        # hit pages that are evictable now stop being evictable once acquired
        hit_evictable = self.cache.num_unreferenced(hit_pages)
        if new_pages + future + reserve > self._free_pages_possible() - hit_evictable:
            if self.running:
                return None
            if new_pages > self._free_pages_possible() - hit_evictable:
                return None
        self.cache.acquire(hit_pages)
        got = self._obtain_pages(new_pages)
        if got is None:
            self.cache.release(hit_pages)
            return None
        req.pages = hit_pages + got
        req.num_cached_pages = len(hit_pages)
        req.kv_len = hit
        req.routed_read = hit  # a cached page's ids: recorded by the step that made it
        req.prefill_target = total
        if not req.admitted_once:
            req.cached_tokens = hit
            req.admitted_once = True
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return BatchRow(req, hit, hit + chunk, samples=hit + chunk == total, from_prev=False)

    def _chunk_row(self, req: Req, budget: int) -> BatchRow | None:
        end = min(req.prefill_target, req.kv_len + budget)
        need = pages_needed(end, self.page_size) - len(req.pages)
        if need > 0:
            got = self._obtain_pages(need)
            if got is None:
                return None
            req.pages.extend(got)
        return BatchRow(req, req.kv_len, end, samples=end == req.prefill_target,
                        from_prev=False)
