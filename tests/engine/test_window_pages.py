"""Pages that left every layer's sliding window (a model whose every layer slides:
ModelConfig.kv_window) are dropped by the scheduler (sched_sim.Sim, no model, no jax): a
long request holds about its window's pages only; what it dropped stays in the prefix
cache as evictable pages (a later request with the same prefix reuses them) or, with the
cache off or suspended, goes back to the free list; the page accounting holds after every
step; a request replaying its routed experts keeps every page."""

from __future__ import annotations

from sched_sim import PAGE, Sim, expected

WINDOW = 10  # positions; pages of PAGE = 4 tokens


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 200 for i in range(n)]


def _most_held(sim: Sim, rid: str) -> int:
    """Run to the end; the most pages request `rid` held at once after a decode step (a
    prefill chunk holds its own pages beside the window's until the next step drops
    them)."""
    most = 0
    while sim.sched.has_work():
        batch = sim.step()
        req = next((r for r in sim.sched.running if r.rid == rid), None)
        decoded = any(row.req is req and row.end - row.start == 1 for row in batch.rows)
        if req is not None and decoded:
            most = max(most, len(req.held_pages))
            assert all(p == 0 for p in req.pages[:req.window_dropped])
    return most


def test_a_long_request_holds_only_its_window_and_the_cache_keeps_the_rest() -> None:
    sim = Sim(num_pages=64, kv_window=WINDOW)
    prompt = _prompt(1, 30)
    sim.add(sim.req("a", prompt, max_new=40))
    most = _most_held(sim, "a")
    assert sim.outputs() == {"a": expected(prompt, 40)}
    # its next query's window, the page it lies in, the page being written, the anchor
    assert most <= -(-WINDOW // PAGE) + 3, most
    # every full page it computed went to the prefix cache (evictable once it ended)
    assert sim.cache.num_cached_pages == (30 + 40 - 1) // PAGE
    assert sim.free_tokens() == sim.allocator.num_usable * PAGE
    again = sim.req("b", prompt + sim.finished["a"].output_ids[:20], max_new=3)
    sim.add(again)
    sim.run()
    assert again.cached_tokens == 48  # the whole prompt's full pages, dropped ones included
    assert sim.finished["b"].output_ids == expected(again.prompt_ids, 3)


def test_dropped_pages_are_reclaimable_while_the_request_runs() -> None:
    sim = Sim(num_pages=64, kv_window=WINDOW)
    req = sim.req("a", _prompt(2, 30), max_new=40)
    sim.add(req)
    for _ in range(30):
        sim.step()
    assert req.window_dropped > 0
    dropped = req.pages[:req.window_dropped]
    assert dropped == [0] * len(dropped)
    # free + evictable + its held pages = everything: the dropped ones are evictable
    held = len(req.held_pages)
    assert sim.free_tokens() // PAGE + held == sim.allocator.num_usable
    sim.run()


def test_without_the_cache_dropped_pages_are_freed() -> None:
    sim = Sim(num_pages=64, kv_window=WINDOW, cache=False)
    prompt = _prompt(3, 30)
    sim.add(sim.req("a", prompt, max_new=40))
    most = _most_held(sim, "a")
    assert most <= -(-WINDOW // PAGE) + 2, most
    assert sim.outputs() == {"a": expected(prompt, 40)}
    assert sim.allocator.num_free == sim.allocator.num_usable


def test_a_suspended_cache_frees_and_the_request_caches_nothing_after() -> None:
    """While the cache is suspended (a weight update with K/V kept), a request frees its
    dropped pages; its chain is broken, so it inserts nothing when it ends (its leading
    pages were freed and may hold another request's K/V now)."""
    sim = Sim(num_pages=64, kv_window=WINDOW)
    old = sim.req("old", _prompt(4, 9), max_new=30)
    sim.add(old)
    sim.step()
    sim.sched.invalidate_kv()  # `old` keeps its K/V: the cache is suspended
    assert sim.cache.suspended
    new = sim.req("new", _prompt(5, 26), max_new=30)
    sim.add(new)
    for _ in range(12):
        sim.step()
    assert new.window_dropped > new.num_cached_pages == 0 and not new.chain_intact
    sim.finish(old)  # the cache reopens
    assert sim.cache.enabled
    sim.run()
    assert sim.cache.num_cached_pages == 0  # nothing of `new` was cached
    assert sim.allocator.num_free == sim.allocator.num_usable


def test_a_request_replaying_routed_experts_keeps_every_page() -> None:
    sim = Sim(num_pages=64, kv_window=WINDOW)
    req = sim.req("a", _prompt(6, 30), max_new=20)
    req.want_routed_experts = True
    sim.add(req)
    for _ in range(15):
        sim.step()
    assert req.window_dropped == 0 and len(req.held_pages) == len(req.pages) > 8
    sim.run()


def test_no_window_drops_nothing() -> None:
    sim = Sim(num_pages=64)
    req = sim.req("a", _prompt(7, 30), max_new=40)
    sim.add(req)
    for _ in range(35):
        sim.step()
    assert req.window_dropped == 0
    sim.run()
