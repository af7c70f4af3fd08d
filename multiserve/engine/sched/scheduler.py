"""Scheduler: decides what the next step computes, and owns every request's state.
Plain Python (never imports jax).

Every step is one ragged batch: one token for each decoding request, plus prefill
chunks (new admissions or the continuation of a chunked prefill) filling the rest of
the token budget. `schedule()` returns the step whole: a `ScheduledBatch` (its
`BatchRow`s, token count and RowPlan: engine/sched/batch.py, engine/sched/row_plan.py, the
one layout of its logits rows); the runner turns it into padded arrays. Which decode rows
verify drafts (speculative decoding) it asks of the DraftPlanner (engine/spec/planner.py,
`self.planner`); it obtains the pages a draft's positions need itself.

The Scheduler is the one writer of Req state (engine/sched/request.py): it admits,
launches, retracts, records a step's results (`postprocess`: tokens, logprobs, the stop
verdict of StopRules) and finishes (`finish`, the one finish path of a Req's state; the
core then delivers). Everything else reads Reqs.

Invariants:
- `reqs` holds every live Req (added, not finished), by (rid, index); `finish` removes it.
- `running` holds every admitted Req that holds KV (decoding or mid-prefill), in
  admission order; `waiting` holds the rest, front first. A Req is in at most one.
- A waiting Req with `pending > 0` (retracted while a step that samples for it was
  in flight) is not admitted until the host has read that token.
- Nothing writes a ScheduledBatch once `schedule()` returned it (frozen, rows too).
- A dispatch of K decode steps (`ScheduledBatch.decode_steps`, `_decode_steps`: decode
  rows that need no host decision between tokens) holds every row's pages for its K
  positions before it is launched; `launch` advances each row K positions, and
  `postprocess_decode_steps` records its K tokens a row in order, up to the first that
  ends the sample.
- `launch(batch)` is called once the runner enqueued the step: only then do kv_len,
  pending and the prefix cache move, so a schedule that was never launched has no
  effect on state beyond page allocation (which `launch` makes permanent).
- When KV runs out for decode, the newest running Reqs are retracted (KV freed into
  the prefix cache or the free list, output kept) to the front of `waiting`.
- After a weight update (`invalidate_kv`), Reqs that kept their K/V hold K/V of the old
  weights: while any of them holds it the prefix cache is suspended (so no other Req
  matches or extends it); when the last gives it back (finish, abort, retract:
  `release_kv`) the cache is emptied and reopened.
- A model whose every layer slides (`kv_window` W > 0) reads no K/V more than W - 1
  positions behind a query: before each step, the pages of a running Req that lie wholly
  before its next query's window (position kv_len - W + 1; every later query's window
  starts later) are dropped (`_drop_out_of_window`). Where the prefix cache can extend
  the Req's chain, its full pages are inserted first and the dropped ones released to
  the cache (evictable: reused by a later request with the same prefix, or evicted under
  pressure, LRU), the chain's last page kept as the anchor of later inserts; elsewhere
  (cache off or suspended) its private ones are freed and it caches nothing more. A Req
  that replays its routed experts keeps every page (its ids are read from them).
- The prefix cache is namespaced by adapter version and cache salt
  (engine/sched/prefix_cache.py roots): a base-model Req (LoRA slot 0) matches and fills
  root 0; a LoRA Req its slot's root, new each time that slot is written
  (`lora_slot_written`); a salted Req (its request's cache_salt) the root of its salt
  under that root, so requests with different salts never share a page and those with
  the same salt share as unsalted ones do. A slot is written only while
  no live Req uses it (engine/core.py `load_lora`, `unload_lora`), so every Req matches
  and fills the root of the version it computes with, and K/V of an adapter version is
  never matched by another version, another adapter or the base model; a replaced
  version's pages are never matched again and age out by LRU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from multiserve.config import EngineConfig
from multiserve.grammar.matcher_state import GrammarState
from multiserve.engine.base.frozen_build import built
from multiserve.engine.base.routed_experts import RoutedExpertsTable
from multiserve.engine.sched.batch import BatchRow, ScheduledBatch
from multiserve.engine.sched.page_allocator import PageAllocator, pages_needed
from multiserve.engine.sched.prefix_cache import PrefixCache
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.row_plan import logit_rows_of
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.spec.drafter import DraftSource
from multiserve.engine.spec.planner import DraftPlanner
from multiserve.types import (
    FinishReason,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
    WeightSegment,
)

log = logging.getLogger(__name__)
MAX_SALTED_ROOTS = 4096  # cache salts remembered (weight versions, tenants, ...)


class StepLogprobSource(Protocol):
    """A step's logprobs read to the host (engine/sampling/logprobs.StepLogprobs)."""

    def token(self, b: int, tok: int, params: SamplingParams) -> TokenLogprob: ...

    def prompt(self, b: int, token: int, params: SamplingParams) -> TokenLogprob: ...


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: PrefixCache,
                 max_context: int, max_tokens_per_step: int, max_rows: int,
                 drafter: DraftSource | None = None,
                 routed_experts: RoutedExpertsTable | None = None,
                 runs_decode_steps: Callable[[int], bool] | None = None,
                 kv_window: int = 0) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.cache = cache
        self.page_size = cfg.page_size
        self.max_context = max_context
        self.max_tokens_per_step = max_tokens_per_step
        self.max_rows = max_rows
        self.reqs: dict[tuple[str, int], Req] = {}  # every live Req
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0
        self._stale_kv: set[Req] = set()  # hold K/V computed with replaced weights
        # LoRA slot -> the prefix-cache root of the adapter version it holds (negative:
        # module docstring), (root, cache salt) -> the root of that salt's namespace, and
        # the next root to hand out (roots are never reused)
        self._lora_roots: dict[int, int] = {}
        self._salted_roots: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._next_lora_root = -1
        # speculative decoding (engine/spec/): which rows verify drafts, the step costs
        # that decide it, the speculation totals; `drafter` None: off
        self.planner = DraftPlanner(cfg, max_rows, max_context, drafter)
        # routing replay (engine/base/routed_experts.py), an engine that captures routed
        # experts: each Req asking for them copies its rows out before its pages go
        # (`finish`, `retract`)
        self.routed_experts = routed_experts
        # whether a decode-only step of n rows can run K decode steps in one
        # dispatch now (the runner's `runs_decode_steps`); None: never
        self.runs_decode_steps = runs_decode_steps
        # a "wait" pause closing admission (EngineCore.pause): only these Reqs, live when
        # it began, may still be admitted from `waiting`; None: admission is open
        self._admit_only: frozenset[Req] | None = None
        # the model's ModelConfig.kv_window (0: some layer reads every earlier key)
        self.kv_window = kv_window

    # ---- queries -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running) or any(r.pending == 0 and self._admissible(r)
                                         for r in self.waiting)

    def _admissible(self, req: Req) -> bool:
        return self._admit_only is None or req in self._admit_only

    # ---- admission gate (a "wait" pause) ---------------------------------------------
    def close_admission(self) -> frozenset[Req]:
        """From now on admit only the Reqs live now (running or waiting, retracted ones
        included); later ones wait in `waiting` until `open_admission`. Returns those."""
        self._admit_only = frozenset(self.reqs.values())
        return self._admit_only

    def open_admission(self) -> None:
        self._admit_only = None

    @property
    def chunked_reqs(self) -> list[Req]:
        return [r for r in self.running if r.in_prefill]

    def available_kv_tokens(self) -> int:
        return self.allocator.num_free * self.page_size

    def private_pages(self) -> int:
        return sum(len(r.pages) - max(r.num_cached_pages, r.window_dropped)
                   for r in self.running)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for r in self.running:
            for p in r.pages[r.window_dropped:r.num_cached_pages]:
                refs[p] = refs.get(p, 0) + 1
        for r in self.waiting:
            assert not r.pages, f"waiting request {r.rid} holds KV pages"
        self.cache.check_integrity(refs, self.private_pages())

    # ---- KV helpers ----------------------------------------------------------------
    def _obtain_pages(self, n: int) -> list[int] | None:
        if not self.allocator.can_allocate(n):
            self.cache.evict(n - self.allocator.num_free)
        if not self.allocator.can_allocate(n):
            return None
        return self.allocator.allocate(n)

    def lora_slot_written(self, slot: int) -> None:
        """LoRA slot `slot` now holds another adapter version (or none): Reqs admitted
        with it from now on match and fill a new prefix-cache root. Between steps, while
        no live Req uses the slot."""
        assert slot > 0, slot
        self._lora_roots[slot] = self._next_lora_root
        self._next_lora_root -= 1

    def _cache_root(self, req: Req) -> int:
        """The prefix-cache root of `req`'s K/V (module docstring). A Req's slot holds an
        adapter only once EngineCore wrote it, which gave the slot its root; a salted Req
        (cache_salt) reads and fills that root's namespace for its salt alone."""
        root = self._lora_roots[req.lora_slot] if req.lora_slot else 0
        return root if req.cache_salt is None else self._salted_root(root, req.cache_salt)

    def _salted_root(self, root: int, salt: str) -> int:
        """The root of `salt`'s namespace under `root`, made on first use. At most
        MAX_SALTED_ROOTS are remembered (least recently used forgotten first): a forgotten
        salt gets a fresh root, its old pages are never matched again and age out."""
        key = (root, salt)
        salted = self._salted_roots.get(key)
        if salted is None:
            salted = self._next_lora_root
            self._next_lora_root -= 1
            self._salted_roots[key] = salted
            if len(self._salted_roots) > MAX_SALTED_ROOTS:
                self._salted_roots.popitem(last=False)
        else:
            self._salted_roots.move_to_end(key)
        return salted

    def _free_pages_possible(self) -> int:
        return self.allocator.num_free + self.cache.num_evictable_pages

    def release_kv(self, req: Req) -> None:
        """Give back a Req's KV: full pages of tokens whose ids and K/V are both known go
        into the prefix cache (while its chain is intact); everything else it holds
        returns to the free list."""
        if req.pages:
            num_cached = self._extend_chain(req, self._known_pages(req))
            self.cache.release(req.pages[req.window_dropped:num_cached])
            self.allocator.free(req.pages[max(num_cached, req.window_dropped):])
        req.pages = []
        req.num_cached_pages = 0
        req.window_dropped = 0
        req.kv_len = 0
        req.routed_read = 0
        req.prefill_target = 0
        if req in self._stale_kv:
            self._stale_kv.discard(req)
            self._check_stale_kv()

    def _known_pages(self, req: Req) -> int:
        """Full pages of `req` whose tokens' ids and K/V are both known."""
        return min(req.kv_len, len(req.prompt_ids) + len(req.output_ids)) // self.page_size

    def _extend_chain(self, req: Req, num_full: int) -> int:
        """Insert `req`'s pages [num_cached_pages, num_full) into the prefix cache where
        its chain is intact; returns (and sets) its number of cached leading pages."""
        if req.chain_intact:
            req.num_cached_pages = self.cache.insert(req.fill_ids, req.pages,
                                                     req.num_cached_pages, num_full,
                                                     self._cache_root(req))
        return req.num_cached_pages

    def _drop_out_of_window(self, req: Req) -> None:
        """Drop the pages of `req` that lie wholly before its next query's window (module
        docstring): released to the prefix cache where its chain extends (the chain's
        last page kept), else released (cached) or freed (private)."""
        ps = self.page_size
        bound = max(0, req.kv_len - self.kv_window + 1) // ps
        if bound <= req.window_dropped or req.want_routed_experts:
            return
        if self.cache.enabled and req.chain_intact:
            self._extend_chain(req, min(bound, self._known_pages(req)))
            end = min(bound, req.num_cached_pages - 1)  # the anchor stays held
        else:
            end = bound
        start = req.window_dropped
        if end <= start:
            return
        cached = req.pages[start:min(end, req.num_cached_pages)]
        self.cache.release(cached)
        self.allocator.free(req.pages[start + len(cached):end])
        req.pages[start:end] = [0] * (end - start)
        req.window_dropped = end

    def drop_cached_kv(self) -> int:
        """Give every cached page no Req holds back to the free list; returns how many."""
        return self.cache.evict(self.cache.num_evictable_pages)

    def invalidate_kv(self) -> tuple[int, int]:
        """The weights changed. Cached K/V nobody holds is dropped; Reqs holding K/V keep it
        and decode on from it, and the cache stays suspended until they all gave it back
        (see the module docstring). Returns (pages dropped, Reqs that kept their K/V)."""
        dropped = self.drop_cached_kv()
        holders = [r for r in self.running if r.pages]
        self._stale_kv.update(holders)
        self._check_stale_kv()
        return dropped, len(holders)

    def _check_stale_kv(self) -> None:
        if self._stale_kv:
            self.cache.suspend()
        elif self.cache.num_referenced_pages == 0:
            self.cache.reopen()

    def _reserved_tokens(self, extra: Req | None = None) -> int:
        """Decode tokens the running Reqs are expected to still need (new_token_ratio)."""
        total = 0
        for r in self.running + ([extra] if extra else []):
            left = max(0, r.params.max_new_tokens - r.num_generated)
            total += int(left * self.new_token_ratio)
        return total

    # ---- admission / removal -------------------------------------------------------
    def add(self, req: Req, lora_slot: int = 0) -> None:
        """A new live Req, waiting (its key is not live: the caller checked), computed with
        the LoRA adapter in `lora_slot` (0: none; the core resolved its name)."""
        req.lora_slot = lora_slot
        self.reqs[req.key] = req
        if req.params.grammar is not None and req.grammar is None:
            k = min(req.params.grammar_resumed, len(req.prompt_ids))
            req.grammar = GrammarState(req.params.grammar,
                                       req.prompt_ids[len(req.prompt_ids) - k:] if k else ())
        self.waiting.append(req)

    def finish(self, req: Req, reason: FinishReason) -> None:
        """The one finish path of a Req's state: finished with `reason`, no longer live,
        its KV released. The state is recorded before the queues are touched, so after a
        fault (queues possibly broken, `remove` raising) the Req still reads finished."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.key, None)
        req.keep_routing(self.routed_experts)
        self.remove(req)
        self.planner.finished(req)

    def remove(self, req: Req) -> None:
        """Drop a Req from whichever queue holds it and release its KV."""
        if req in self.running:
            self.running.remove(req)
            self.release_kv(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def retract(self, reqs: list[Req]) -> None:
        """Move running Reqs (KV freed, output kept) to the front of waiting, in their
        original order."""
        for req in reversed(reqs):
            self.running.remove(req)
            req.keep_routing(self.routed_experts)
            self.release_kv(req)
            req.status = RequestStatus.WAITING
            req.num_retractions += 1
            self.num_retractions += 1
            self.waiting.appendleft(req)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step, complete (rows, token count, row plan); None: nothing to run.
        Nothing writes the batch after this returns."""
        if self.kv_window:
            for req in self.running:
                self._drop_out_of_window(req)
        rows = self._decode_rows()
        if self.planner.on and not self._prefill_pending():
            # (a prefill's step is compute-bound: drafts would slow it)
            rows = self._add_drafts(rows)
        tokens = sum(r.end - r.start for r in rows)
        logit_rows = sum(logit_rows_of(r) for r in rows)
        budget = min(self.cfg.chunked_prefill_size, self.max_tokens_per_step - tokens)
        rows += self._prefill_rows(budget, self.max_rows - logit_rows)
        if not rows:
            return None
        return ScheduledBatch.of(rows, self._decode_steps(rows))

    def _decode_steps(self, rows: list[BatchRow]) -> int:
        """How many decode steps the step of `rows` runs in one dispatch: the config's K
        where every row is a decode row that needs no per-token host decision
        (`_takes_decode_steps`), the runner has the program, and every row's pages for K
        positions are obtained (those obtained stay its own, for the steps to come,
        whatever the answer); else 1. A stop inside the K steps is found afterwards
        (`postprocess_decode_steps`): the tokens sampled past it are dropped with its
        pages."""
        k = self.cfg.decode_steps_per_dispatch
        if k == 1 or self.runs_decode_steps is None or not all(
                self._takes_decode_steps(r, k) for r in rows):
            return 1
        if not self.runs_decode_steps(len(rows)):
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

    # ---- after launch --------------------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> None:
        """The runner enqueued `batch`: advance positions and cache new full prefill pages."""
        decoded = False
        for b, row in enumerate(batch.rows):
            req = row.req
            was_prefill = req.in_prefill
            req.kv_len = row.end + batch.decode_steps - 1
            if row.samples:
                req.pending += batch.decode_steps
                req.last_out_row = b
            if was_prefill:
                self._extend_chain(req, row.end // self.page_size)
            else:
                decoded = True
        if decoded:
            self.new_token_ratio = max(self.cfg.min_new_token_ratio,
                                       self.new_token_ratio - self.cfg.new_token_ratio_decay)

    def reset_ratio(self) -> None:
        self.new_token_ratio = self.cfg.init_new_token_ratio

    # ---- a step's results (the host read them) -------------------------------------
    def postprocess(self, batch: ScheduledBatch, next_ids: Sequence[int],
                    logprobs: StepLogprobSource | None, weight_version: str,
                    rules: StopRules) -> list[Req]:
        """Record the results of launched step `batch`: prompt logprobs of its prompt
        rows, and per sampling row its token (with logprob record and weight version)
        and the stop verdict (finishing the Req). Returns the Reqs with output to deliver
        now (finished, or streaming), in row order."""
        for i in batch.plan.prompt_rows:
            req, j = batch.plan.rows[i].req, batch.plan.rows[i].j
            if not req.finished and len(req.prompt_logprobs) == j:
                assert logprobs is not None, "prompt rows always return logprobs"
                req.prompt_logprobs.append(logprobs.prompt(i, req.prompt_ids[j], req.params))
        for row in batch.rows:  # the table holds these rows' ids now (core._process)
            if not row.req.finished:
                row.req.routed_read = max(row.req.routed_read, row.end)
        deliver: list[Req] = []
        for b, row in enumerate(batch.rows):
            req = row.req
            if not row.samples or req.finished:
                continue
            if row.draft:
                if self._verify(batch, b, next_ids, logprobs, weight_version, rules):
                    deliver.append(req)
                continue
            req.pending -= 1
            if req.params.max_new_tokens == 0:  # scoring: the prompt is done, no token
                self.finish(req, "length")
                deliver.append(req)
                continue
            tok = int(next_ids[b])
            self._record_token(req, tok, logprobs, b, weight_version)
            reason, matched = rules.verdict(req, tok)
            if reason is None and req.grammar is not None:
                reason = self._grammar_verdict(req, tok)
            elif req.grammar is not None:
                req.grammar.advance(tok)
            if reason is not None:
                req.matched_stop = matched
                self.finish(req, reason)
                deliver.append(req)
            elif req.stream:
                deliver.append(req)
        return deliver

    def postprocess_decode_steps(self, batch: ScheduledBatch,
                                 step_ids: Sequence[Sequence[int]],
                                 logprobs: Sequence[StepLogprobSource] | None,
                                 weight_version: str, rules: StopRules) -> list[Req]:
        """`postprocess` of a dispatch that ran `batch.decode_steps` decode steps
        (`step_ids[k]`: the ids step k sampled, by row; `logprobs[k]`: its logprobs). Each
        row's tokens are recorded in order, each judged by the stop rules as a single
        step's is, until one ends the sample: the tokens after it were sampled past the end
        and are dropped, and the finish gives back its pages, K/V past the end included.
        Returns the Reqs with output to deliver now, in row order."""
        deliver: list[Req] = []
        for b, row in enumerate(batch.rows):
            req = row.req
            if req.finished:
                continue
            req.routed_read = max(req.routed_read, row.end + batch.decode_steps - 1)
            req.pending -= batch.decode_steps
            for k in range(batch.decode_steps):
                tok = int(step_ids[k][b])
                self._record_token(req, tok, logprobs[k] if logprobs is not None else None,
                                   b, weight_version)
                reason, matched = rules.verdict(req, tok)
                if reason is not None:
                    req.matched_stop = matched
                    self.finish(req, reason)
                    deliver.append(req)
                    break
            else:
                if req.stream:
                    deliver.append(req)
        return deliver

    @staticmethod
    def _grammar_verdict(req: Req, tok: int) -> FinishReason | None:
        """Advance a constrained Req's matcher by its new token: "stop" once the grammar
        is complete (nothing but EOS allowed), "abort" with `req.error` naming the token if
        it rejects it (only a token the mask allowed can be sampled, so this is a broken
        grammar state, e.g. a resumed output the grammar never admitted)."""
        assert req.grammar is not None
        if not req.grammar.advance(tok):
            req.error = f"the grammar rejected token {tok}: {req.grammar.error}"
            log.warning("request %s: %s", req.rid, req.error)
            return "abort"
        return "stop" if req.grammar.done else None

    def _record_token(self, req: Req, tok: int, logprobs: StepLogprobSource | None,
                      logits_row: int, weight_version: str) -> None:
        """One emitted token of `req`: its id, the weight version it came from, its
        logprob record (from logits row `logits_row`) where asked for."""
        req.output_ids.append(tok)
        if not req.weight_segments or \
                req.weight_segments[-1].weight_version != weight_version:
            req.weight_segments.append(WeightSegment(len(req.output_ids) - 1, weight_version))
        if logprobs is not None and req.params.wants_logprobs:
            req.output_logprobs.append(logprobs.token(logits_row, tok, req.params))

    def _verify(self, batch: ScheduledBatch, b: int, next_ids: Sequence[int],
                logprobs: StepLogprobSource | None, weight_version: str,
                rules: StopRules) -> bool:
        """Record verify row b: the samples at its positions in order, each one emitted,
        until one differs from its draft token (emitted in its place) or ends the sample;
        all drafts accepted: the sample after the last one too. K/V of the positions not
        kept (rejected drafts) is dropped: kv_len moves back and pages past it are freed,
        so nothing rejected reaches the prefix cache. Returns whether to deliver now."""
        row = batch.rows[b]
        req, draft = row.req, row.draft
        k = len(draft)
        req.pending -= 1
        holds_kv = req.status is RequestStatus.RUNNING  # not retracted meanwhile
        if holds_kv:
            req.kv_len = row.start  # then one more per emitted token
        accepted = 0
        ended = False
        for j in range(k + 1):
            logits_row = batch.plan.verify_row(b, j) if j < k else b
            tok = int(next_ids[logits_row])
            if holds_kv:
                req.kv_len += 1
            self._record_token(req, tok, logprobs, logits_row, weight_version)
            reason, matched = rules.verdict(req, tok)
            if reason is not None:
                req.matched_stop = matched
                if j < k and tok == draft[j]:
                    accepted += 1
                self.finish(req, reason)
                ended = True
                break
            if j == k or tok != draft[j]:
                break
            accepted += 1
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.planner.verified(req, k, accepted)
        if holds_kv and not ended:
            keep = pages_needed(req.kv_len, self.page_size)
            if len(req.pages) > keep:
                assert keep >= req.num_cached_pages
                self.allocator.free(req.pages[keep:])
                del req.pages[keep:]
        return ended or req.stream
