"""A step's decode rows (a part of the Scheduler, engine/sched/scheduler.py): one row per
decoding Req, retracting the newest running Reqs while their next pages cannot all be had
(`_decode_rows`); the drafts the DraftPlanner (engine/spec/planner.py) gives some of them,
each such row becoming a verify row of its draft's positions (`_add_drafts`,
`_set_draft`); and whether the step runs K decode steps in one dispatch
(`_decode_steps`): from the engine's config (decode_steps_per_dispatch K, the context),
the rows (none needing a host decision between tokens) and the compiled sizes the core
gave (`self.compiled`, engine/sched/compiled_sizes.py). Plain Python (never imports jax).
"""

from __future__ import annotations

from dataclasses import replace

from multiserve.engine.base.frozen_build import built
from multiserve.engine.sched.batch import BatchRow
from multiserve.engine.sched.page_allocator import pages_needed
from multiserve.engine.sched.state import SchedulerState


class DecodeRows(SchedulerState):
    def _decode_rows(self) -> list[BatchRow]:
        ps = self.page_size
        while True:
            decoding = [r for r in self.running if not r.in_prefill and r.wants_more()
                        and r.kv_len + 1 < self.max_context]
            need = [r for r in decoding if r.kv_len >= len(r.pages) * ps]
            if len(need) <= self._free_pages_possible():
                break
            # (at most one dispatch's tokens in flight)
            victims = [r for r in self.running
                       if r.pending <= self.cfg.decode_steps_per_dispatch]
            if len(victims) <= 1:
                break
            self.retract([victims[-1]])
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        rows: list[BatchRow] = []
        for r in decoding:
            if r.kv_len >= len(r.pages) * ps:
                got = self._obtain_pages(1)
                if got is None:
                    continue  # cannot happen after the loop above unless one Req remains
                r.pages.extend(got)
            # (one per decode row per step: `built`, engine/base/frozen_build.py)
            rows.append(built(BatchRow, req=r, start=r.kv_len, end=r.kv_len + 1, samples=True,
                              from_prev=r.pending > 0, draft=()))
        return rows

    def _decode_steps(self, rows: list[BatchRow]) -> int:
        """How many decode steps the step of `rows` runs in one dispatch: the config's K
        where every row is a decode row that needs no per-token host decision
        (`_takes_decode_steps`), its size has the program (`self.compiled`, the sizes the
        core gave), and every row's pages for K
        positions are obtained (those obtained stay its own, for the steps to come,
        whatever the answer); else 1. A stop inside the K steps is found afterwards
        (`postprocess_decode_steps`): the tokens sampled past it are dropped with its
        pages."""
        k = self.cfg.decode_steps_per_dispatch
        if k == 1 or not all(self._takes_decode_steps(r, k) for r in rows):
            return 1
        if not self.compiled.runs_decode_steps(len(rows)):
            return 1
        for row in rows:
            req = row.req
            need = pages_needed(row.start + k, self.page_size) - len(req.pages)
            if need > 0:
                got = self._obtain_pages(need)
                if got is None:
                    return 1
                req.pages.extend(got)
        return k

    def _takes_decode_steps(self, row: BatchRow, k: int) -> bool:
        """Row `row` may run k decode steps without the host between them: a decode row
        (one token, not a draft, not mid-prefill) whose sampler inputs do not depend on
        its output (no penalty, grammar, min_new_tokens still ahead: no bans), that never
        needs routing replay's ids, and whose k positions fit the context. EOS, stop ids,
        stop strings and the length limit need nothing before the next token: they are
        checked on the k tokens afterwards, in order."""
        req = row.req
        p = req.params
        return (row.samples and not row.draft and row.end - row.start == 1
                and not req.in_prefill and req.grammar is None and not p.has_penalty
                and req.num_generated >= p.min_new_tokens and not req.want_routed_experts
                and row.start + k < self.max_context)

    def wants_drafts(self) -> bool:
        """Whether the next step could verify drafts (DraftPlanner.wants_drafts, no prompt
        waiting to prefill). Then the step in flight is read before the next is scheduled
        (a draft needs every token known); otherwise overlap goes on."""
        if not self.planner.on or self._prefill_pending():
            return False
        return self.planner.wants_drafts(
            [r for r in self.running if not r.in_prefill and r.wants_more()])

    def _add_drafts(self, rows: list[BatchRow]) -> list[BatchRow]:
        """`rows` (decode rows) with the planner's drafts: a row given a draft becomes a
        verify row (`_set_draft`)."""
        return [self._set_draft(row, draft) if draft else row
                for row, draft in zip(rows, self.planner.drafts(rows), strict=True)]

    def _prefill_pending(self) -> bool:
        """A prompt waits for admission or is mid-prefill: the next steps carry its chunks."""
        return any(r.pending == 0 for r in self.waiting) or any(
            r.in_prefill for r in self.running)

    def _set_draft(self, row: BatchRow, draft: tuple[int, ...]) -> BatchRow:
        """`row` verifying `draft` (pages for its positions obtained: where they cannot
        be, only what the pages held already cover)."""
        req = row.req
        have = len(req.pages) * self.page_size
        need = pages_needed(row.end + len(draft), self.page_size) - len(req.pages)
        if need > 0:
            got = self._obtain_pages(need)
            if got is None:
                draft = draft[:max(0, have - row.end)]
            else:
                req.pages.extend(got)
        if not draft:
            return row
        return replace(row, draft=draft, end=row.end + len(draft))
