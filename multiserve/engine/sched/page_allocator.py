"""Host-side KV memory: the page allocator and the per-request page table.

Owns: which KV pages are free. The device KV pool itself lives in the runner; this
module never touches device memory and never imports jax.

Invariants:
- Page 0 is reserved: padding tokens write their K/V there and padding page-table
  entries point at it, so it is never handed out. Pages [1, num_pages) are allocatable.
- A page is in exactly one of: free (here), owned privately by one Req, or held by the
  prefix cache (referenced or evictable). `PrefixCache.check_integrity` checks the sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 2, "need page 0 (padding) and at least one usable page"
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = []
        self._is_free = np.zeros(num_pages, dtype=bool)
        self.reset()

    def reset(self) -> None:
        # Stack: pop() hands out low page ids first (stable, easy to read in dumps).
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._is_free[:] = True
        self._is_free[0] = False

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert self.can_allocate(n), f"allocate({n}) with only {len(self._free)} free pages"
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        self._is_free[pages] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        if not pages:
            return
        arr = np.asarray(pages)
        assert (arr > 0).all(), "page 0 is reserved and never freed"
        assert not self._is_free[arr].any(), f"double free of pages {pages}"
        assert len(set(pages)) == len(pages), f"duplicate pages in free({pages})"
        self._is_free[arr] = True
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that cover positions [0, num_tokens)."""
    return -(-num_tokens // page_size)


def slot_for(pages: Sequence[int], pos: int, page_size: int) -> int:
    """The flat KV slot (page * page_size + offset) of position `pos` (one of slots_for's)."""
    page, offset = divmod(pos, page_size)
    return pages[page] * page_size + offset


def slots_for(pages: Sequence[int], start: int, end: int, page_size: int) -> np.ndarray:
    """Flat KV slots (page * page_size + offset) of positions [start, end)."""
    pos = np.arange(start, end)
    page_arr = np.asarray(pages, dtype=np.int64)
    return (page_arr[pos // page_size] * page_size + pos % page_size).astype(np.int32)
