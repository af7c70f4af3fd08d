"""Control calls racing from several threads (issue 4): pause (every mode), continue,
abort_request, flush_cache, state reads and integrity checks, while another thread keeps
submitting requests. Nothing deadlocks (every thread ends within a bound), the page
accounting holds throughout, every request ends exactly once, and every output is the
uninterrupted one (or, when aborted, a prefix of it).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from engine_helpers import TINY_ENGINE, TINY_VOCAB, Collector

from multiserve.engine.commands import CheckIntegrity, InjectFault
from multiserve.types import ControlResult, SamplingParams

THREAD_BOUND_S = 90.0


def _work(n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(21)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 80))]
        max_new = rng.randrange(8, 40)
        params = (SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
                  if i % 2 else SamplingParams(temperature=0.9, seed=i, max_new_tokens=max_new,
                                               ignore_eos=True, n=1 + (i % 3 == 0)))
        out.append((prompt, params))
    return out


def test_concurrent_control_never_corrupts_or_deadlocks(tiny_engine: Any) -> None:
    eng = tiny_engine
    work = _work(36)
    ref = Collector(eng)
    ref.submit_all([p for p, _ in work], [s for _, s in work], prefix="c")
    want = {k: o.output_ids for k, o in ref.wait().items()}

    col = Collector(eng)
    rids = [f"c{i}" for i in range(len(work))]
    errors: list[BaseException] = []
    results: list[ControlResult] = []
    done_submitting = threading.Event()

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
        return run

    @guarded
    def submitter() -> None:
        rng = random.Random(0)
        for rid, (prompt, params) in zip(rids, work, strict=True):
            col.submit(rid, prompt, params)
            time.sleep(rng.random() * 0.01)
        done_submitting.set()

    def controller(seed: int) -> Any:
        @guarded
        def run() -> None:
            rng = random.Random(seed)
            for _ in range(30):
                op = rng.choices(["pause", "continue", "abort", "flush", "state", "check"],
                                 weights=[3, 4, 1, 2, 2, 2])[0]
                if op == "pause":
                    mode = rng.choice(["retract", "in_place", "in_place", "retract", "abort"]
                                      if seed == 0 else ["retract", "in_place"])
                    results.append(eng.pause_generation(mode))
                elif op == "continue":
                    results.append(eng.continue_generation())
                elif op == "abort":
                    results.append(eng.abort_request(rng.choice(rids)))
                elif op == "flush":
                    results.append(eng.flush_cache())
                elif op == "state":
                    st = eng.get_internal_state()
                    assert st["running_batch_size"] + st["waiting_queue_size"] <= 48
                else:
                    eng.call(CheckIntegrity()).result()
                time.sleep(rng.random() * 0.01)
        return run

    threads = [threading.Thread(target=submitter)]
    threads += [threading.Thread(target=controller(s)) for s in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, THREAD_BOUND_S - (time.monotonic() - start)))
    assert not any(t.is_alive() for t in threads), "a control call deadlocked"
    assert not errors, errors
    assert done_submitting.is_set()
    assert all(isinstance(r, ControlResult) for r in results)
    refusals = [r for r in results if not r.ok]
    assert all("cannot flush" in r.message for r in refusals), refusals

    eng.continue_generation()
    got = col.wait()
    assert set(got) == set(want)
    for key, out in got.items():
        if out.finish_reason == "abort":
            assert out.output_ids == want[key][:len(out.output_ids)], key
        else:
            assert out.finish_reason == "length" and out.output_ids == want[key], key
    eng.call(CheckIntegrity()).result()


def test_shutdown_under_concurrent_calls_ends_everything(tiny_model_dir: Any) -> None:
    """Shutting an engine down while threads keep calling it: every request gets one
    final (aborted, with the reason) output, every call returns or raises
    EngineUnavailable, and no thread is left waiting."""
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.types import EngineUnavailable

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **TINY_ENGINE))
    col = Collector(eng)
    col.submit_all([[5, 6, 7, 8]] * 4, SamplingParams(max_new_tokens=500, ignore_eos=True))
    stop = threading.Event()
    outcomes: list[str] = []

    def caller() -> None:
        while not stop.is_set():
            try:
                eng.get_internal_state()
                outcomes.append("ok")
            except EngineUnavailable:
                outcomes.append("refused")
                return

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    failures: list[BaseException] = []

    def shut() -> None:
        try:
            eng.shutdown()  # two at once: both return once the engine is down
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    shutters = [threading.Thread(target=shut) for _ in range(2)]
    for t in shutters:
        t.start()
    for t in shutters + threads:
        t.join(timeout=THREAD_BOUND_S)
    stop.set()
    assert not any(t.is_alive() for t in shutters + threads), "a call outlived shutdown"
    assert not failures, failures
    assert eng.health() == (False, "engine is shut down")
    assert outcomes.count("refused") == 3
    got = col.wait(timeout=10)
    assert len(got) == 4
    assert all(o.finish_reason == "abort" and o.error for o in got.values())


def test_a_failing_step_marks_the_engine_unhealthy_and_ends_every_request(
        tiny_model_dir: Any) -> None:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.types import EngineUnavailable, GenerateRequest

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **TINY_ENGINE))
    try:
        col = Collector(eng)
        col.submit_all([[5, 6, 7]] * 3, SamplingParams(max_new_tokens=500, ignore_eos=True))
        eng.call(InjectFault("boom: injected")).result()
        got = col.wait(timeout=30)
        assert all(o.finish_reason == "abort" and "boom: injected" in o.error
                   for o in got.values())
        healthy, reason = eng.health()
        assert not healthy and "boom: injected" in reason
        with pytest.raises(EngineUnavailable, match="boom"):
            eng.submit(GenerateRequest(rid="late", input_ids=(5,),
                                       sampling=SamplingParams(max_new_tokens=2)), print)
        st = eng.get_internal_state()  # still answers, and the KV came back
        assert st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0
        assert st["available_kv_tokens"] + st["evictable_kv_tokens"] == \
            st["initial_available_kv_tokens"]
        eng.call(CheckIntegrity()).result()
    finally:
        eng.shutdown()
