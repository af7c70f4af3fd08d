"""The Scheduler's state (engine/sched/scheduler.py): every live Req and the queues that
hold it, the KV pages each holds, the prefix cache's namespaces (roots), and the moves of a
Req's state that every part of a step uses: admit to `waiting` (`add`), `finish`, `remove`,
`retract`, and the KV helpers (obtain pages, give a Req's KV back, drop pages behind a
sliding window, invalidate K/V after a weight update). Plain Python (never imports jax).

The step's parts build on it, one job each: decode_rows.py (the decode rows, their drafts,
and whether they run K decode steps in one dispatch), prefill_rows.py (admission and
prefill chunks), postprocess.py (a step's results, stops); scheduler.py joins them.
The invariants are scheduler.py's.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from multiserve.config import EngineConfig
from multiserve.engine.base.routed_experts import RoutedExpertsTable
from multiserve.engine.sched.compiled_sizes import CompiledSizes
from multiserve.engine.sched.page_allocator import PageAllocator
from multiserve.engine.sched.prefix_cache import PrefixCache
from multiserve.engine.sched.request import Req
from multiserve.engine.spec.drafter import DraftSource
from multiserve.engine.spec.planner import DraftPlanner
from multiserve.grammar.matcher_state import GrammarState
from multiserve.types import FinishReason, RequestStatus

MAX_SALTED_ROOTS = 4096  # cache salts remembered (weight versions, tenants, ...)


class SchedulerState:
    """The state every part of a step reads and writes, and its moves (module docstring)."""

    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: PrefixCache,
                 max_context: int, max_tokens_per_step: int, max_rows: int,
                 drafter: DraftSource | None = None,
                 routed_experts: RoutedExpertsTable | None = None,
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
        # the step programs ready now, by size (EngineCore gives a new one before each
        # schedule while decode_steps_per_dispatch K > 1): whether a decode step may run
        # K decode steps in one dispatch (decode_rows.py); none at first: never
        self.compiled = CompiledSizes()
        # a "wait" pause closing admission (EngineCore.pause): only these Reqs, live when
        # it began, may still be admitted from `waiting`; None: admission is open
        self._admit_only: frozenset[Req] | None = None
        # the model's ModelConfig.kv_window (0: some layer reads every earlier key)
        self.kv_window = kv_window

    def has_work(self) -> bool:
        return bool(self.running) or any(r.pending == 0 and self._admissible(r)
                                         for r in self.waiting)

    def _admissible(self, req: Req) -> bool:
        return self._admit_only is None or req in self._admit_only

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

    def reset_ratio(self) -> None:
        self.new_token_ratio = self.cfg.init_new_token_ratio
