"""Pause / continue / abort on the tiny engine (issue 4): what each mode does to the queues
and the KV, that outputs survive pauses unchanged (in float32 and in bfloat16), the
quiescence barrier, and abort.

Pauses land at exact points: a sink hook (`AtTokens`) queues the control call when a
request has produced k tokens, before the engine can start another step.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_helpers import (
    TINY_VOCAB,
    AtTokens,
    Collector,
    Trigger,
    ids_and_logprobs,
    passes_settled,
)

from multiserve.engine.commands import CheckIntegrity
from multiserve.types import GenerateRequest, SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                        return_logprob=True)


def _work(seed: int, n: int = 8) -> list[tuple[list[int], SamplingParams]]:
    """n requests of ragged prompt lengths; even ones greedy, odd ones seeded sampling."""
    rng = random.Random(seed)
    work = []
    for i in range(n):
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 70))]
        params = GREEDY if i % 2 == 0 else SamplingParams(
            temperature=0.8, top_p=0.9, seed=1000 + i, max_new_tokens=MAX_NEW, ignore_eos=True,
            return_logprob=True)
        work.append((prompt, params))
    return work


def _prefix_of(out: Any, full: tuple) -> bool:
    n = len(out.output_ids)
    return (out.output_ids, tuple(t.logprob for t in out.logprobs)) == (full[0][:n], full[1][:n])


def _submit(col: Collector, work: list[tuple[list[int], SamplingParams]]) -> list[str]:
    return col.submit_all([p for p, _ in work], [s for _, s in work])


@pytest.fixture(scope="module")
def uninterrupted() -> dict[tuple[str, int], dict]:
    """Outputs of each (engine dtype, workload seed) run without any pause (memoised)."""
    return {}


@pytest.fixture
def engine(tiny_engine_each_dtype: Any) -> Any:
    """The tiny engine in each compute dtype (float32, bfloat16): the tests of outputs
    surviving pauses run in both."""
    return tiny_engine_each_dtype


def _reference(engine: Any, cache: dict, seed: int) -> dict:
    key = (engine.get_internal_state()["dtype"], seed)
    if key not in cache:
        col = Collector(engine)
        _submit(col, _work(seed))
        cache[key] = ids_and_logprobs(col.wait())
    return cache[key]


def _state(engine: Any):  # noqa: ANN202 - a factory for Trigger
    return lambda: engine.acontrol("get_internal_state")


def _pause(engine: Any, mode: str):  # noqa: ANN202
    return lambda: engine.acontrol("pause_generation", mode=mode)


def test_pause_retract(engine: Any, trigger: Trigger, uninterrupted: dict) -> None:
    want = _reference(engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 8, _state(engine), _pause(engine, "retract"))
    col = Collector(engine, on_output=hook)
    _submit(col, _work(0))
    before, res = hook.wait()
    after = engine.get_internal_state()
    assert res.ok and res.details["retracted"] == before["running_batch_size"] > 0
    assert after["engine_paused"] and after["running_batch_size"] == 0
    assert after["waiting_queue_size"] == before["waiting_queue_size"] + res.details["retracted"]
    assert after["waiting_rids"][:len(before["running_rids"])] == before["running_rids"]
    gain = after["available_kv_tokens"] - before["available_kv_tokens"]
    assert gain == res.details["freed_kv_tokens"] > 0
    # What the retracted requests held is now free or kept (unreferenced) by the cache.
    assert after["available_kv_tokens"] + after["evictable_kv_tokens"] == \
        after["initial_available_kv_tokens"]
    assert after["req_to_token_pool_used"] == 0
    assert engine.continue_generation().ok
    got = col.wait()
    assert all(o.finish_reason == "length" for o in got.values())
    assert ids_and_logprobs(got) == want


@pytest.mark.parametrize("mode", ["in_place", "keep"])  # vLLM's name of in_place
def test_pause_in_place(engine: Any, trigger: Trigger, uninterrupted: dict, mode: str) -> None:
    want = _reference(engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 8, _state(engine), _pause(engine, mode))
    col = Collector(engine, on_output=hook)
    _submit(col, _work(0))
    before, res = hook.wait()
    assert res.ok and res.details["mode"] == "in_place"
    keys = ("running_batch_size", "running_rids", "waiting_queue_size", "waiting_rids",
            "available_kv_tokens", "tree_cache_size", "req_to_token_pool_used")
    after = engine.get_internal_state()
    assert before["running_batch_size"] > 0
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
    tokens = {k: len(v[-1].output_ids) for k, v in col.snapshots.items()}
    later = passes_settled(engine)  # nothing may move while paused
    assert {k: later[k] for k in keys} == {k: before[k] for k in keys}
    assert later["forward_ct"] == after["forward_ct"]
    assert later["empty_passes"] == after["empty_passes"] == 0
    assert {k: len(v[-1].output_ids) for k, v in col.snapshots.items()} == tokens
    assert engine.continue_generation().ok
    got = col.wait()
    assert all(o.finish_reason == "length" for o in got.values())
    assert ids_and_logprobs(got) == want


def test_five_cycles_alternating_modes_at_random_steps(engine: Any, trigger: Trigger,
                                                       uninterrupted: dict) -> None:
    want = _reference(engine, uninterrupted, 1)
    rng = random.Random(42)
    steps = sorted(rng.sample(range(2, MAX_NEW - 2), 5))
    modes = ["retract", "in_place", "retract", "in_place", "retract"]
    hooks = [AtTokens(trigger, "r0", k, _pause(engine, m)) for k, m in zip(steps, modes)]

    def on_output(out: Any) -> None:
        for h in hooks:
            h(out)

    col = Collector(engine, on_output=on_output)
    _submit(col, _work(1))
    for hook, mode in zip(hooks, modes, strict=True):
        (res,) = hook.wait()
        assert res.ok and res.details["mode"] == mode
        st = engine.get_internal_state()
        assert st["engine_paused"]
        if mode == "retract":
            assert st["running_batch_size"] == 0 and res.details["retracted"] > 0
        engine.call(CheckIntegrity()).result()
        assert engine.continue_generation().ok
    got = col.wait()
    assert all(o.finish_reason == "length" for o in got.values())
    assert ids_and_logprobs(got) == want


def test_pause_abort_returns_partial_prefixes(engine: Any, trigger: Trigger,
                                             uninterrupted: dict) -> None:
    want = _reference(engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 8, _pause(engine, "abort"))
    col = Collector(engine, on_output=hook)
    rids = _submit(col, _work(0))
    (res,) = hook.wait()
    got = col.wait()
    assert res.ok and res.details["aborted"] == len(rids)
    st = engine.get_internal_state()
    assert st["engine_paused"]
    assert st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0
    assert len(got) == len(rids)
    for key, out in got.items():
        assert out.finish_reason == "abort"
        assert _prefix_of(out, want[key])
    assert len(got[("r0", 0)].output_ids) >= 8
    assert engine.continue_generation().ok


def test_pause_and_continue_twice_are_noops(tiny_engine: Any) -> None:
    res = tiny_engine.continue_generation()
    assert res.ok and "not paused" in res.message
    assert tiny_engine.pause_generation("in_place").ok
    again = tiny_engine.pause_generation("retract")
    assert again.ok and "already paused" in again.message
    assert tiny_engine.get_internal_state()["engine_paused"]
    assert tiny_engine.continue_generation().ok
    assert not tiny_engine.get_internal_state()["engine_paused"]


def test_abort_request_one_and_unknown(tiny_engine: Any, trigger: Trigger,
                                      uninterrupted: dict) -> None:
    want = _reference(tiny_engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 6, lambda: tiny_engine.acontrol("abort_request", rid="r3"))
    col = Collector(tiny_engine, on_output=hook)
    _submit(col, _work(0))
    (res,) = hook.wait()
    assert res.ok and res.details["aborted"] == 1
    got = col.wait()
    for key, out in got.items():
        if key[0] == "r3":
            assert out.finish_reason == "abort" and len(out.output_ids) < MAX_NEW
            assert _prefix_of(out, want[key])
        else:
            assert out.finish_reason == "length" and ids_and_logprobs({key: out})[key] == want[key]
    unknown = tiny_engine.abort_request("no-such-rid")
    assert unknown.ok and unknown.details["aborted"] == 0 and "no-such-rid" in unknown.message


def test_aborted_stream_ends_cleanly(tiny_engine: Any) -> None:
    req = GenerateRequest(rid="to-abort", input_ids=(5, 6, 7), sampling=GREEDY.with_updates(
        max_new_tokens=200), stream=True)
    seen = []
    for out in tiny_engine.stream_sync(req):
        seen.append(out)
        if len(out.output_ids) == 3 and not out.finished:
            assert tiny_engine.abort_request("to-abort").details["aborted"] == 1
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert 3 <= len(seen[-1].output_ids) < 200
    assert sum(o.finished for o in seen) == 1


# ---- the barrier ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_barrier_no_step_while_paused_and_new_requests_wait(
        tiny_engine: Any, trigger: Trigger, uninterrupted: dict, mode: str) -> None:
    want = _reference(tiny_engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 5, _pause(tiny_engine, mode))
    col = Collector(tiny_engine, on_output=hook)
    _submit(col, _work(0))
    hook.wait()
    s1 = tiny_engine.get_internal_state()
    late = _work(7, n=3)
    late_rids = col.submit_all([p for p, _ in late], [s for _, s in late], prefix="late")
    s2 = passes_settled(tiny_engine)  # the loop has decided, with the late requests queued
    assert s2["forward_ct"] == s1["forward_ct"]
    assert s2["forward_ct_decode"] == s1["forward_ct_decode"]
    assert s2["running_batch_size"] == s1["running_batch_size"]
    assert s2["waiting_rids"][-3:] == late_rids
    assert s2["waiting_queue_size"] == s1["waiting_queue_size"] + 3
    assert s2["available_kv_tokens"] == s1["available_kv_tokens"]
    assert all(k[0] not in late_rids for k in col.snapshots)  # no output while paused
    # the paused loop wakes only for commands: never a pass with neither command nor step
    assert s2["empty_passes"] == s1["empty_passes"] == 0, "the paused loop is busy-waiting"
    assert tiny_engine.continue_generation().ok
    got = col.wait()
    assert {k: v for k, v in ids_and_logprobs(got).items() if k in want} == want
    late_alone = Collector(tiny_engine)
    late_alone.submit_all([p for p, _ in late], [s for _, s in late], prefix="late")
    for key, out in late_alone.wait().items():
        assert got[key].finish_reason == "length"
        assert ids_and_logprobs({key: got[key]}) == ids_and_logprobs({key: out})


# ---- vLLM's "wait" mode and clear_cache ------------------------------------------------------

def test_pause_wait_lets_live_requests_finish_and_queues_new_ones(
        tiny_engine: Any, trigger: Trigger, uninterrupted: dict) -> None:
    """The pause answers once every request live when it arrived has finished, as if
    unpaused; requests sent after it wait (admission closed), then run after continue
    with the outputs they have alone."""
    want = _reference(tiny_engine, uninterrupted, 0)
    late = [p for p, _ in _work(7, n=3)]
    col = Collector(tiny_engine)

    def send_late() -> Any:  # queued right behind the pause, before any step
        return col.asubmit_all(late, GREEDY, "late")

    hook = AtTokens(trigger, "r0", 5, _pause(tiny_engine, "wait"), send_late)
    col.on_output = hook
    rids = _submit(col, _work(0))
    res, late_rids = hook.wait()
    assert res.ok and res.details["mode"] == "wait" and res.details["finished"] == len(rids)
    st = passes_settled(tiny_engine)
    assert st["engine_paused"] and st["pause_reasons"] == ["user"]
    assert st["pause_pending"] is None and st["running_batch_size"] == 0
    assert st["waiting_rids"] == late_rids  # queued, never admitted
    done = {k: v[-1] for k, v in col.snapshots.items() if k[0] in rids}
    assert all(o.finished and o.finish_reason == "length" for o in done.values())
    assert ids_and_logprobs(done) == want
    assert not any(k[0] in late_rids for k in col.snapshots)
    assert tiny_engine.continue_generation().ok
    got = col.wait()
    alone = Collector(tiny_engine)
    alone.submit_all(late, GREEDY, prefix="late")
    assert {k: v for k, v in ids_and_logprobs(got).items() if k[0] in late_rids} == \
        ids_and_logprobs(alone.wait())


def test_continue_cancels_a_draining_wait_pause(tiny_engine: Any, trigger: Trigger,
                                                uninterrupted: dict) -> None:
    want = _reference(tiny_engine, uninterrupted, 0)
    hook = AtTokens(trigger, "r0", 4, _pause(tiny_engine, "wait"),
                    lambda: tiny_engine.acontrol("continue_generation"))
    col = Collector(tiny_engine, on_output=hook)
    _submit(col, _work(0))
    paused, continued = hook.wait()
    assert not paused.ok and paused.details["cancelled"]
    assert continued.ok and continued.details["cancelled_wait_pause"]
    assert ids_and_logprobs(col.wait()) == want
    st = tiny_engine.get_internal_state()
    assert not st["engine_paused"] and st["pause_pending"] is None


def test_pause_clear_cache_drops_unreferenced_pages(tiny_engine: Any) -> None:
    prompt = list(range(3, 60))
    out = tiny_engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out.finish_reason == "length"
    assert tiny_engine.get_internal_state()["tree_cache_size"] > 0
    res = tiny_engine.pause_generation("abort", clear_cache=True)
    assert res.ok and res.details["cleared_cached_pages"] > 0
    assert tiny_engine.get_internal_state()["tree_cache_size"] == 0
    assert tiny_engine.continue_generation().ok
    again = tiny_engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again.cached_tokens == 0
    assert ids_and_logprobs({0: again}) == ids_and_logprobs({0: out})


def test_wait_is_no_hold_mode() -> None:
    from multiserve.control_ops import PauseGeneration, ReleaseMemoryOccupation

    assert PauseGeneration(mode="keep").mode == "in_place"
    assert ReleaseMemoryOccupation(mode="keep").mode == "in_place"
    with pytest.raises(ValueError, match="mode"):
        ReleaseMemoryOccupation(mode="wait")
