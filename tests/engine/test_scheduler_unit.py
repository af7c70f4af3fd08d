"""The Scheduler (engine/sched/scheduler.py) driven without a model (sched_sim.Sim): admission,
chunked prefill, prefix hits, retraction under KV pressure and by hand, eviction, steps of
K decode steps per dispatch, and the page accounting after every step; no jax."""

from __future__ import annotations

import pytest
from sched_sim import PAGE, Sim, expected, fake_token

from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.compiled_sizes import CompiledSizes
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.types import RequestStatus, SamplingParams


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 200 for i in range(n)]


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    sim = Sim()
    r = sim.req("a", _prompt(1, 10), max_new=3)
    sim.add(r)
    first = sim.step()
    assert first is not None and first.num_tokens == 10 and first.rows[0].samples
    assert sim.step().num_tokens == 1 and r.kv_len == 11
    assert sim.run() == 1
    assert sim.outputs() == {"a": expected(r.prompt_ids, 3)}
    assert sim.free_tokens() == sim.allocator.num_usable * PAGE  # everything back


def test_long_prompt_is_chunked_and_samples_only_at_its_end() -> None:
    sim = Sim(max_tokens=8)
    r = sim.req("a", _prompt(2, 20), max_new=2)
    sim.add(r)
    sizes = []
    while r.in_prefill or not r.admitted_once:
        batch = sim.step()
        sizes.append(batch.num_tokens)
        assert batch.rows[0].samples == (not r.in_prefill)
    assert sizes == [8, 8, 4] and r.output_ids == expected(r.prompt_ids, 1)
    sim.run()
    assert sim.outputs() == {"a": expected(r.prompt_ids, 2)}


def test_admission_is_fifo_under_the_token_budget() -> None:
    sim = Sim(max_tokens=16)
    reqs = [sim.req(f"r{i}", _prompt(i, 6), max_new=2) for i in range(4)]
    sim.add(*reqs)
    batch = sim.step()
    # 6 + 6 + 4 (a chunk of the third); the fourth waits, in order
    assert [(row.req.rid, row.end - row.start) for row in batch.rows] == [
        ("r0", 6), ("r1", 6), ("r2", 4)]
    assert [r.rid for r in sim.sched.waiting] == ["r3"]
    sim.run()
    assert sim.outputs() == {r.rid: expected(r.prompt_ids, 2) for r in reqs}


def test_max_running_requests_caps_admission() -> None:
    sim = Sim(max_running_requests=2)
    reqs = [sim.req(f"r{i}", _prompt(i, 3), max_new=3) for i in range(3)]
    sim.add(*reqs)
    sim.step()
    assert [r.rid for r in sim.sched.running] == ["r0", "r1"]
    sim.run()
    assert set(sim.finished) == {"r0", "r1", "r2"}


def test_a_shared_prefix_is_reused_and_the_last_token_recomputed() -> None:
    sim = Sim()
    shared = _prompt(3, 12)  # 3 full pages
    a = sim.req("a", shared + [7], max_new=2)
    sim.add(a)
    sim.run()
    b = sim.req("b", shared + [9, 9], max_new=2)
    c = sim.req("c", shared, max_new=2)  # the whole prompt cached: recompute its last page
    sim.add(b, c)
    batch = sim.step()
    assert {row.req.rid: (row.start, row.end) for row in batch.rows} == {
        "b": (12, 14), "c": (8, 12)}
    assert b.cached_tokens == 12 and c.cached_tokens == 8
    sim.run()
    assert sim.outputs()["b"] == expected(b.prompt_ids, 2)
    assert sim.outputs()["c"] == expected(c.prompt_ids, 2)


def test_decode_under_kv_pressure_retracts_the_newest_and_loses_nothing() -> None:
    # 8 usable pages of 4 tokens; three requests that each end at 4 pages, all admitted
    # at once (a low expected-decode reserve), so decode runs out of KV
    sim = Sim(num_pages=9, max_context=64, init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    reqs = [sim.req(f"r{i}", _prompt(i, 5), max_new=11) for i in range(3)]
    sim.add(*reqs)
    sim.run()
    assert sim.sched.num_retractions > 0
    assert max(r.num_retractions for r in reqs) > 0
    assert sim.outputs() == {r.rid: expected(r.prompt_ids, 11) for r in reqs}
    assert sim.free_tokens() == 8 * PAGE


def test_retract_by_hand_keeps_order_output_and_frees_kv() -> None:
    sim = Sim()
    reqs = [sim.req(f"r{i}", _prompt(i, 9), max_new=6) for i in range(3)]
    later = sim.req("w", _prompt(9, 3), max_new=2)
    sim.add(*reqs)
    sim.step()
    sim.step()
    sim.add(later)
    running = list(sim.sched.running)
    outputs = {r.rid: list(r.output_ids) for r in running}
    before = sim.allocator.num_free
    sim.sched.retract(running)
    assert [r.rid for r in sim.sched.waiting] == ["r0", "r1", "r2", "w"]
    assert all(not r.pages and r.kv_len == 0 and r.status is RequestStatus.WAITING
               for r in running)
    assert {r.rid: r.output_ids for r in running} == outputs  # output kept
    assert sim.allocator.num_free + sim.cache.num_evictable_pages > before
    sim.sched.check_integrity()
    sim.run()
    assert sim.outputs() == {r.rid: expected(r.prompt_ids, r.params.max_new_tokens)
                             for r in [*reqs, later]}


def test_a_retracted_request_with_a_token_in_flight_waits_for_it() -> None:
    sim = Sim()
    r = sim.req("a", _prompt(4, 5), max_new=4)
    sim.add(r)
    batch = sim.sched.schedule()
    sim.sched.launch(batch)  # launched, not read: one token pending on the "device"
    sim.sched.retract([r])
    assert r.pending == 1 and not sim.sched.has_work()
    assert sim.sched.schedule() is None  # not re-admitted before its token is read
    r.pending -= 1
    r.output_ids.append(7)
    assert sim.sched.has_work() and sim.sched.schedule() is not None


def test_allocation_evicts_unreferenced_cache_pages_first() -> None:
    sim = Sim(num_pages=9)
    a = sim.req("a", _prompt(5, 16), max_new=1)
    sim.add(a)
    sim.run()
    assert sim.cache.num_evictable_pages == 4 and sim.allocator.num_free == 4
    b = sim.req("b", _prompt(6, 24), max_new=1)  # needs 6 pages, 4 are free
    sim.add(b)
    sim.run()
    assert sim.outputs()["b"] == expected(b.prompt_ids, 1)
    # b's second chunk needed 2 pages more than were free: a's two deepest pages went
    # (leaves before parents); its first two still match
    assert len(sim.cache.match(a.prompt_ids, 16)) == 2


def test_a_prompt_that_cannot_fit_waits_instead_of_failing() -> None:
    sim = Sim(num_pages=5, max_tokens=32)  # 4 usable pages = 16 tokens
    big = sim.req("big", _prompt(7, 15), max_new=1)
    small = sim.req("small", _prompt(8, 6), max_new=8)
    sim.add(small)
    sim.step()
    sim.add(big)
    sim.run()
    assert set(sim.finished) == {"big", "small"}


def test_n_samples_wait_for_their_leader_to_prefill() -> None:
    sim = Sim(max_tokens=8)
    lead = sim.req("n", _prompt(9, 12), max_new=2, index=0)
    sib = sim.req("n", _prompt(9, 12), max_new=2, index=1)
    sib.leader = lead
    sim.add(lead, sib)
    batch = sim.step()
    assert [row.req.index for row in batch.rows] == [0]
    sim.step()  # the leader's last chunk
    batch = sim.step()
    assert sib in [row.req for row in batch.rows] and sib.cached_tokens == 8


def test_remove_releases_kv_from_either_queue() -> None:
    sim = Sim()
    a, b = sim.req("a", _prompt(1, 9)), sim.req("b", _prompt(2, 9))
    sim.add(a)
    sim.step()
    sim.add(b)
    sim.sched.remove(a)
    sim.sched.remove(b)
    assert not sim.sched.running and not sim.sched.waiting
    sim.sched.check_integrity()
    assert sim.free_tokens() == sim.allocator.num_usable * PAGE


def test_integrity_check_catches_a_leaked_page() -> None:
    sim = Sim()
    sim.add(sim.req("a", _prompt(1, 9)))
    sim.step()
    sim.allocator.allocate(1)
    with pytest.raises(AssertionError, match="accounting"):
        sim.sched.check_integrity()


def test_invalidate_kv_suspends_the_cache_until_the_last_old_kv_holder_lets_go() -> None:
    # a weight update (Scheduler.invalidate_kv): cached pages nobody holds are dropped;
    # a running Req keeps its K/V (of the old weights) and, while it holds it, nobody
    # matches or extends the cache; its release empties and reopens the cache
    sim = Sim()
    shared = _prompt(3, 12)
    sim.add(sim.req("a", shared + [5], max_new=1))
    sim.run()
    assert sim.cache.num_evictable_pages == 3
    old = sim.req("old", shared + [6], max_new=3)
    sim.add(old)
    sim.step()
    assert old.cached_tokens == 12 and old.pages
    cached_before = sim.cache.num_evictable_pages
    dropped, kept = sim.sched.invalidate_kv()
    assert (dropped, kept) == (cached_before, 1)
    assert sim.cache.suspended and not sim.cache.enabled
    new = sim.req("new", shared + [7], max_new=2)
    sim.add(new)
    sim.step()
    assert new.cached_tokens == 0  # K/V of the old weights is never matched
    sim.finish(old)  # the last holder of old K/V lets go
    assert not sim.cache.suspended and sim.cache.enabled
    assert sim.cache.num_cached_pages == 0
    sim.run()
    sim.sched.check_integrity()
    again = sim.req("again", shared + [8], max_new=1)
    sim.add(again)
    sim.step()
    assert again.cached_tokens == 12  # "new" (new weights) cached it after the reopen
    assert sim.free_tokens() + sum(len(r.pages) for r in sim.sched.running) * PAGE == \
        sim.allocator.num_usable * PAGE


def test_invalidate_kv_with_no_holder_empties_the_cache_at_once() -> None:
    sim = Sim()
    sim.add(sim.req("a", _prompt(4, 9), max_new=1))
    sim.run()
    assert sim.cache.num_cached_pages == 2
    assert sim.sched.invalidate_kv() == (2, 0)
    assert sim.cache.enabled and sim.cache.num_cached_pages == 0


def test_a_retracted_old_kv_holder_also_reopens_the_cache() -> None:
    sim = Sim()
    r = sim.req("r", _prompt(5, 9), max_new=4)
    sim.add(r)
    sim.step()
    sim.sched.invalidate_kv()
    assert sim.cache.suspended
    sim.sched.retract([r])
    assert not sim.cache.suspended and sim.cache.num_cached_pages == 0
    sim.run()
    assert sim.outputs() == {"r": expected(r.prompt_ids, 4)}


# every step size of a Sim (8 rows at most) has its own buckets and a DECODE_STEPS program
EVERY_SIZE = CompiledSizes(forward=(1, 2, 4, 8, 16), head=(1, 2, 4, 8),
                           decode_steps=(1, 2, 4, 8))


def test_k_decode_steps_run_where_the_step_pads_to_a_size_with_the_program() -> None:
    compiled = CompiledSizes(forward=(1, 8, 16), head=(1, 8), decode_steps=(8,))
    # 2..8 rows pad to 8 tokens and 8 rows: the program of 8; 1 row has none; 9 rows
    # pad to 16 tokens, more rows than any head bucket holds
    assert [compiled.runs_decode_steps(n) for n in (1, 2, 8, 9)] == [False, True, True,
                                                                      False]
    # the step's token and row buckets differ: no fused size, no program
    assert not CompiledSizes((1, 16), (1, 8), (8, 16)).runs_decode_steps(2)
    assert not CompiledSizes().runs_decode_steps(1)  # nothing told: single steps


def _run_decode_steps(sim: Sim, rules: StopRules) -> ScheduledBatch:
    """Schedule and launch one step, read it at once: K decode steps' tokens (fake_token) per
    row recorded by `postprocess_decode_steps`, or a single step's by `Sim.step`'s
    bookkeeping."""
    batch = sim.sched.schedule()
    assert batch is not None
    sim.sched.launch(batch)
    seqs = [list(row.req.fill_ids[:row.end]) for row in batch.rows]
    step_ids: list[list[int]] = []
    for _ in range(batch.decode_steps):
        step_ids.append([fake_token(seq) for seq in seqs])
        for seq, tok in zip(seqs, step_ids[-1], strict=True):
            seq.append(tok)
    for req in sim.sched.postprocess_decode_steps(batch, step_ids, None, "v", rules):
        if req.finished:
            sim.finished[req.rid] = req
    sim.sched.check_integrity()
    return batch


def test_k_decode_steps_hold_k_positions_and_record_tokens_up_to_the_stop() -> None:
    sim = Sim(decode_steps_per_dispatch=4)
    # the runner has the program of every size
    sim.sched.compiled = EVERY_SIZE
    a, b = sim.req("a", _prompt(1, 6), max_new=7), sim.req("b", _prompt(2, 5), max_new=3)
    sim.add(a, b)
    assert sim.step().decode_steps == 1  # the prefill: a single step
    stop = expected(a.prompt_ids, 7)[3]  # a's 4th token, sampled by the first dispatch
    rules = StopRules(frozenset({stop}), 256)
    batch = _run_decode_steps(sim, rules)
    assert batch.decode_steps == 4 and [row.end - row.start for row in batch.rows] == [1, 1]
    # b reached its length at its 3rd token (step 1): the later steps' tokens dropped,
    # and its pages (K/V past its end included) given back
    assert b.finished and sim.outputs()["b"] == expected(b.prompt_ids, 3)
    first = expected(a.prompt_ids, 7).index(stop)
    assert 1 <= first <= 3  # sampled inside the dispatch (step first - 1), steps after it
    assert a.finished and a.finish_reason == "stop" and a.matched_stop == stop
    assert a.output_ids == expected(a.prompt_ids, first + 1)
    assert sim.free_tokens() + sum(len(r.pages) for r in sim.sched.running) * PAGE == \
        sim.allocator.num_usable * PAGE


def test_a_row_that_needs_the_host_between_tokens_runs_single_steps() -> None:
    sim = Sim(decode_steps_per_dispatch=4)
    sim.sched.compiled = EVERY_SIZE
    plain = sim.req("plain", _prompt(3, 6), max_new=9)
    penalised = Req("pen", 0, _prompt(4, 6), SamplingParams(max_new_tokens=9,
                                                            frequency_penalty=0.5),
                    0, lambda out: None)
    sim.add(plain, penalised)
    sim.step()
    assert sim.sched.schedule().decode_steps == 1  # one penalised row: the step is single
    sim.sched.finish(penalised, "abort")
    rules = StopRules(frozenset(), 256)
    batch = _run_decode_steps(sim, rules)
    # (the step scheduled above was never launched: nothing moved)
    assert batch.decode_steps == 4 and plain.kv_len == 6 + 4
    assert len(plain.output_ids) == 1 + 4
    assert plain.output_ids == expected(plain.prompt_ids, 5)
    sim.sched.compiled = CompiledSizes((8,), (8,), ())  # no program of this size (yet)
    assert _run_decode_steps(sim, rules).decode_steps == 1 and plain.kv_len == 6 + 4 + 1
