"""Batch admission is atomic (issue 10, item 10): `Engine.generate(list_of_prompts)` sends
ONE command to the engine thread for the whole batch, so once it is submitted every
prompt is running or waiting, and a `pause_generation("abort")` or
`abort_request(abort_all=True)` issued then aborts all of them; a batch with an invalid
member (a repeated rid) admits none.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from engine_helpers import restore

from multiserve.engine.commands import Add
from multiserve.types import GenerateRequest, SamplingParams

N = 16
LONG = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0.0}


def _prompts() -> list[list[int]]:
    return [[1, 100 + i, 7, 40 + i] for i in range(N)]


def _spy_adds(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every Add command sent to the engine thread (its future)."""
    adds: list[Any] = []
    real = engine.call

    def call(cmd: Any) -> Any:
        fut = real(cmd)
        if isinstance(cmd, Add):
            adds.append((len(cmd.reqs), fut))
        return fut

    monkeypatch.setattr(engine, "call", call)
    return adds


@pytest.mark.parametrize("stop", ["pause_abort", "abort_all"])
def test_generate_list_is_one_command_and_a_following_abort_gets_all(
        tiny_engine: Any, monkeypatch: pytest.MonkeyPatch, stop: str) -> None:
    engine = tiny_engine
    adds = _spy_adds(engine, monkeypatch)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(
        engine.generate(input_ids=_prompts(), sampling_params=LONG)))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while not (adds and adds[0][1].done()):  # the batch's one command has run
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.001)
        state = engine.get_internal_state()
        assert state["running_batch_size"] + state["waiting_queue_size"] == N, state
        if stop == "pause_abort":
            assert engine.pause_generation("abort").ok
        else:
            assert engine.abort_request(abort_all=True).ok
        worker.join(60)
        assert not worker.is_alive()
    finally:
        restore(engine)
        worker.join(60)
    assert [n for n, _ in adds] == [N]  # one command carried the whole batch
    outs = result[0]
    assert len(outs) == N
    assert {o.finish_reason for o in outs} == {"abort"}
    assert all(len(o.output_ids) < LONG["max_new_tokens"] for o in outs)


def test_a_refused_member_admits_none(tiny_engine: Any) -> None:
    engine = tiny_engine
    reqs = [GenerateRequest(rid=rid, input_ids=(1, 5, 9),
                            sampling=SamplingParams(max_new_tokens=4))
            for rid in ("dup-a", "dup-b", "dup-a")]
    got: list[Any] = []
    with pytest.raises(ValueError, match="rid"):
        engine.submit_many(reqs, [got.append] * len(reqs))
    state = engine.get_internal_state()
    assert state["running_batch_size"] + state["waiting_queue_size"] == 0
    assert got == []
