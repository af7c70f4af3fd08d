"""PrefixCache (engine/sched/prefix_cache.py) on its own: full-page keys, ref counts, LRU eviction
(leaves before parents), shared content, reset; no model, no jax."""

from __future__ import annotations

import pytest

from multiserve.engine.sched.page_allocator import PageAllocator
from multiserve.engine.sched.prefix_cache import PrefixCache

PS = 4


def _cache(num_pages: int = 17, enabled: bool = True) -> tuple[PrefixCache, PageAllocator]:
    a = PageAllocator(num_pages, PS)
    return PrefixCache(a, PS, enabled=enabled), a


def _hold(c: PrefixCache, a: PageAllocator, ids: list[int]) -> list[int]:
    """A request that computed `ids`: its pages, full ones cached (it holds a ref on them)."""
    pages = a.allocate(-(-len(ids) // PS))
    assert c.insert(ids, pages, 0, len(ids) // PS) == len(ids) // PS
    return pages


def _check(c: PrefixCache, a: PageAllocator, holders: list[list[int]], private: int) -> None:
    refs: dict[int, int] = {}
    for pages in holders:
        for p in pages:
            refs[p] = refs.get(p, 0) + 1
    c.check_integrity(refs, private)


def test_only_full_pages_are_cached_and_matched() -> None:
    c, a = _cache()
    ids = list(range(10, 20))  # 2 full pages + 2 tokens
    pages = _hold(c, a, ids)
    assert c.num_cached_pages == 2 and c.num_referenced_pages == 2
    _check(c, a, [pages[:2]], private=1)
    assert c.match(ids, len(ids)) == pages[:2]
    assert c.match(ids, 7) == pages[:1]  # a page is matched only if wholly within max
    assert c.match(ids[:4] + [0] * 6, 10) == pages[:1]  # diverges in the 2nd page
    assert c.match([0] + ids[1:], 10) == []
    assert c.hit_tokens == 8 + 4 + 4 and c.query_tokens == 10 + 7 + 10 + 10


def test_release_makes_pages_evictable_and_acquire_takes_them_back() -> None:
    c, a = _cache()
    pages = _hold(c, a, list(range(12)))
    c.release(pages)
    assert c.num_evictable_pages == 3 and c.num_referenced_pages == 0
    _check(c, a, [], private=0)
    assert c.num_unreferenced(pages[:2]) == 2
    c.acquire(pages[:2])
    assert c.num_evictable_pages == 1
    _check(c, a, [pages[:2]], private=0)
    with pytest.raises(AssertionError, match="unreferenced"):
        c.release(pages[2:])


def test_eviction_is_lru_and_leaves_go_before_their_parents() -> None:
    c, a = _cache()
    old = _hold(c, a, list(range(8)))  # pages A1 A2
    new = _hold(c, a, list(range(100, 112)))  # pages B1 B2 B3
    c.release(old)
    c.release(new)
    # release pushes deeper pages first: A2, A1, B3, B2, B1 (oldest first)
    free = a.num_free
    assert c.evict(1) == 1 and a.num_free == free + 1
    assert c.match(list(range(8)), 8) == old[:1]  # A2 gone, A1 still matches
    assert c.evict(2) == 2  # A1, then B3
    assert c.match(list(range(100, 112)), 12) == new[:2]
    assert c.evict(99) == 2  # only what is evictable
    assert c.num_cached_pages == 0 and a.num_free == a.num_usable


def test_referenced_pages_are_never_evicted() -> None:
    c, a = _cache()
    held = _hold(c, a, list(range(8)))
    assert c.evict(5) == 0 and c.match(list(range(8)), 8) == held


def test_a_parent_evicted_first_strands_its_children_until_lru_reaches_them() -> None:
    c, a = _cache()
    pages = _hold(c, a, list(range(12)))
    c.release(pages[2:])  # the deepest page alone becomes evictable
    c.release(pages[:2])
    c.acquire(pages[2:])  # an odd holder keeps the leaf; parents age out
    assert c.evict(2) == 2
    assert c.match(list(range(12)), 12) == []  # unreachable without its parents
    _check(c, a, [pages[2:]], private=0)
    c.release(pages[2:])
    assert c.evict(1) == 1 and c.num_cached_pages == 0


def test_same_content_twice_shares_one_page() -> None:
    c, a = _cache()
    ids = list(range(40, 48))
    first = _hold(c, a, ids)
    mine = a.allocate(2)  # a concurrent request computed the same prefix
    free = a.num_free
    assert c.insert(ids, mine, 0, 2) == 2
    assert mine == first and a.num_free == free + 2  # switched to the cached pages
    _check(c, a, [first, mine], private=0)


def test_insert_extends_from_the_cached_prefix() -> None:
    c, a = _cache()
    ids = list(range(16))
    pages = a.allocate(4)
    assert c.insert(ids, pages, 0, 1) == 1
    assert c.insert(ids, pages, 1, 3) == 3
    assert c.insert(ids, pages, 3, 3) == 3  # nothing new
    assert c.match(ids, 16) == pages[:3]
    _check(c, a, [pages[:3]], private=1)


def test_disabled_cache_neither_matches_nor_inserts() -> None:
    c, a = _cache(enabled=False)
    pages = a.allocate(2)
    assert c.insert(list(range(8)), pages, 0, 2) == 0
    assert c.match(list(range(8)), 8) == [] and c.num_cached_pages == 0


def test_reset_drops_everything_but_not_while_referenced() -> None:
    c, a = _cache()
    pages = _hold(c, a, list(range(8)))
    with pytest.raises(AssertionError, match="in use"):
        c.reset()
    c.release(pages)
    assert c.reset() == 2
    assert c.num_cached_pages == 0 and c.hit_tokens == 0 and a.num_free == a.num_usable


def test_integrity_catches_a_leak_and_a_wrong_ref_count() -> None:
    c, a = _cache()
    pages = _hold(c, a, list(range(8)))
    with pytest.raises(AssertionError, match="ref"):
        _check(c, a, [], private=0)
    a.allocate(1)  # a page nobody accounts for
    with pytest.raises(AssertionError, match="accounting"):
        _check(c, a, [pages], private=0)


def test_roots_are_namespaces_that_never_share_a_page() -> None:
    """The same ids cached under the base model's root 0 and under two adapter versions'
    roots (-1, -2): each lookup finds only its own root's pages; extending a matched
    prefix stays under its root."""
    c, a = _cache()
    ids = list(range(30, 42))  # 3 full pages
    base = _hold(c, a, ids)
    assert c.match(ids, len(ids), root=-1) == []
    v1 = a.allocate(2)
    assert c.insert(ids, v1, 0, 2, root=-1) == 2
    assert c.match(ids, len(ids), root=-1) == v1
    assert c.match(ids, len(ids), root=-2) == []
    assert c.match(ids, len(ids)) == base
    v1.append(a.allocate(1)[0])  # the version's request extends its 2 cached pages
    assert c.insert(ids, v1, 2, 3, root=-1) == 3
    assert c.match(ids, len(ids), root=-1) == v1 and not set(v1) & set(base)
    _check(c, a, [base, v1], private=0)
