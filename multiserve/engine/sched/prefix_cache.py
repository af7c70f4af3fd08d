"""Prefix cache: a radix tree over full KV pages, with ref counts and LRU eviction.

Each cached page is a node keyed by (parent node id, the page's token ids); a lookup
walks from a root one full page at a time and the key is exact (no hash collisions).
Roots are namespaces of K/V that the same token ids give different values in, or that
requests must not share: root 0 is the base model's unsalted one; a negative root is one
version of one LoRA adapter (the scheduler's `lora_slot_written`) or one cache salt under
such a root (the scheduler's `_salted_root`). Node ids are positive, so two roots never
share a node: a lookup from one root never reaches a page computed under another. Only
FULL pages are cached; a request always recomputes at least its last token (it needs
that token's logits).

Invariants:
- A cached page has a ref count = number of live Reqs that list it among their
  `num_cached_pages` leading pages. ref > 0: in use; ref == 0: evictable (LRU order,
  oldest first). Evicting a node returns its page to the allocator; descendants of an
  evicted node become unreachable and are evicted in turn as LRU reaches them
  (release pushes deeper pages first, so leaves age before their parents).
- Cached K/V is only valid for the weights that produced it: on a weight update the
  scheduler drops what nobody holds and `suspend()`s the cache while requests still hold
  K/V of the old weights (no match, no insert); `reopen()` empties it and ends that.
- `enabled` = configured (not `disable_prefix_cache`) and not suspended.
- check_integrity(): free + evictable + referenced + privately owned == usable pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from multiserve.engine.sched.page_allocator import PageAllocator


@dataclass
class _Node:
    node_id: int
    page: int
    key: tuple[int, tuple[int, ...]]
    ref: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.configured = enabled  # the engine's config; a suspension is temporary
        self._suspended = False
        self._by_key: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._by_page: dict[int, _Node] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # page -> None, LRU first
        self._next_id = 1
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.configured and not self._suspended

    @property
    def suspended(self) -> bool:
        return self._suspended

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced_pages(self) -> int:
        return len(self._by_page) - len(self._evictable)

    def num_unreferenced(self, pages: Sequence[int]) -> int:
        """How many of these cached pages are evictable now (no live holder)."""
        return sum(1 for p in pages if self._by_page[p].ref == 0)

    def match(self, token_ids: Sequence[int], max_tokens: int, root: int = 0) -> list[int]:
        """Pages of the longest cached full-page prefix of token_ids[:max_tokens] under
        `root` (the module docstring)."""
        assert root <= 0, root
        pages: list[int] = []
        if not self.enabled:
            return pages
        ps = self.page_size
        parent = root
        for start in range(0, max_tokens - ps + 1, ps):
            node = self._by_key.get((parent, tuple(token_ids[start:start + ps])))
            if node is None:
                break
            pages.append(node.page)
            parent = node.node_id
        self.query_tokens += max_tokens
        self.hit_tokens += len(pages) * ps
        return pages

    # ---- ref counting --------------------------------------------------------------
    def acquire(self, pages: Sequence[int]) -> None:
        for p in pages:
            node = self._by_page[p]
            if node.ref == 0:
                del self._evictable[p]
            node.ref += 1

    def release(self, pages: Sequence[int]) -> None:
        # Deepest first, so leaves become older (evicted sooner) than their parents.
        for p in reversed(pages):
            node = self._by_page[p]
            assert node.ref > 0, f"release of unreferenced cached page {p}"
            node.ref -= 1
            if node.ref == 0:
                self._evictable[p] = None

    # ---- insertion -----------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: list[int], num_cached: int,
               num_full: int, root: int = 0) -> int:
        """Cache full pages [num_cached, num_full) of a Req (token_ids covers them) under
        `root`, the root its leading cached pages (if any) were matched under.

        The Req holds a reference on every returned cached page. Where the same content
        is already cached under another page (a concurrent identical prefix), the Req
        switches to the cached page and its own copy is freed. Mutates `pages` in
        place; returns the new number of cached leading pages."""
        if not self.enabled or num_full <= num_cached:
            return num_cached
        assert root <= 0, root
        ps = self.page_size
        parent = self._by_page[pages[num_cached - 1]].node_id if num_cached else root
        for i in range(num_cached, num_full):
            key = (parent, tuple(token_ids[i * ps:(i + 1) * ps]))
            node = self._by_key.get(key)
            if node is None:
                node = _Node(self._next_id, pages[i], key, ref=1)
                self._next_id += 1
                self._by_key[key] = node
                self._by_page[node.page] = node
            else:
                if node.page != pages[i]:
                    self.acquire([node.page])
                    self.allocator.free([pages[i]])
                    pages[i] = node.page
                else:  # pragma: no cover - a Req never re-inserts its own cached page
                    raise AssertionError("page already cached for this Req")
            parent = node.node_id
        return num_full

    # ---- eviction ------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Return up to num_pages LRU evictable pages to the allocator; returns count."""
        freed: list[int] = []
        while self._evictable and len(freed) < num_pages:
            page, _ = self._evictable.popitem(last=False)
            node = self._by_page.pop(page)
            del self._by_key[node.key]
            freed.append(page)
        self.allocator.free(freed)
        return len(freed)

    def suspend(self) -> None:
        """Stop matching and inserting (cached K/V may belong to replaced weights) until
        `reopen()`. References held keep being released as their requests end."""
        self._suspended = True

    def reopen(self) -> int:
        """Empty the cache (see `reset`) and end a suspension; returns pages dropped."""
        dropped = self.reset()
        self._suspended = False
        return dropped

    def reset(self) -> int:
        """Drop every cached page. Only legal when no Req references any (asserted).
        Returns the number of pages dropped (they go back to the allocator)."""
        assert self.num_referenced_pages == 0, "reset while cached pages are in use"
        n = self.num_cached_pages
        self.evict(n)
        self._by_key.clear()
        self._by_page.clear()
        self._evictable.clear()
        self._next_id = 1
        self.hit_tokens = 0
        self.query_tokens = 0
        return n

    # ---- checks --------------------------------------------------------------------
    def check_integrity(self, live_refs: dict[int, int], private_pages: int) -> None:
        """Assert the page accounting. live_refs: cached page -> number of live Reqs
        holding it (computed by the scheduler from its Reqs)."""
        for page, node in self._by_page.items():
            assert node.ref == live_refs.get(page, 0), (
                f"page {page}: ref {node.ref} != {live_refs.get(page, 0)} live holders")
            assert (node.ref == 0) == (page in self._evictable), f"page {page} LRU state"
        extra = set(live_refs) - set(self._by_page)
        assert not extra, f"Reqs reference uncached pages {sorted(extra)[:8]}"
        total = (self.allocator.num_free + self.num_evictable_pages
                 + self.num_referenced_pages + private_pages)
        assert total == self.allocator.num_usable, (
            f"page accounting broken: free {self.allocator.num_free} + evictable "
            f"{self.num_evictable_pages} + referenced {self.num_referenced_pages} + private "
            f"{private_pages} != usable {self.allocator.num_usable}")
