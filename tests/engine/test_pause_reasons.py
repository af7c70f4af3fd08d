"""Pause reasons (issue 12): a user's pause survives every hold (weights staged, memory
released), and a user pause taken while a hold is active takes effect (retract retracts).

The engine is paused while its set of pause reasons is non-empty; each subsystem adds and
removes only its own reason ("user", "weights_staged", "memory_released").
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger

from multiserve.types import SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                        return_logprob=True)
LATE = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _prompts(seed: int = 3, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 40))]
            for _ in range(n)]


def _no_step_runs(engine: Any, col: Collector) -> None:
    """Two command round trips later, the paused engine has run no step and produced no
    token (the loop runs every queued command before it would step)."""
    tokens = {k: len(v[-1].output_ids) for k, v in col.snapshots.items()}
    before = engine.get_internal_state()["forward_ct"]
    assert engine.get_internal_state()["forward_ct"] == before
    assert {k: len(v[-1].output_ids) for k, v in col.snapshots.items()} == tokens


@pytest.mark.xfail(strict=True, reason="issue 12: publish undoes the user's pause")
def test_user_pause_survives_publish(tiny_engine: Any, tiny_model_dir: Path) -> None:
    staged = tiny_engine.stage_weights_from_disk(str(tiny_model_dir), "default")
    assert staged.ok, staged
    paused = tiny_engine.pause_generation("in_place")
    assert paused.ok and not paused.details.get("already_paused"), paused
    assert tiny_engine.publish_staged_weights(staged.details["token"]).ok
    col = Collector(tiny_engine)
    col.submit("late", _prompts()[0], LATE)
    st = tiny_engine.get_internal_state()
    assert st["engine_paused"] and st["waiting_rids"] == ["late"]
    _no_step_runs(tiny_engine, col)
    assert tiny_engine.continue_generation().ok
    assert col.wait()[("late", 0)].finish_reason == "length"


@pytest.mark.xfail(strict=True, reason="issue 12: resume undoes the user's pause, and a "
                   "retract during a release never happens")
def test_user_retract_during_release_retracts_and_survives_resume(
        tiny_engine: Any, trigger: Trigger) -> None:
    col0 = Collector(tiny_engine)
    col0.submit_all(_prompts(), GREEDY)
    want = {k: (o.output_ids, o.logprobs) for k, o in col0.wait().items()}
    hook = AtTokens(trigger, "r0", 4, lambda: tiny_engine.async_release_memory_occupation(
        mode="in_place", preserve_state=True))
    col = Collector(tiny_engine, on_output=hook)
    col.submit_all(_prompts(), GREEDY)
    (rel,) = hook.wait()
    assert rel.ok and rel.details["preserved_requests"] > 0, rel
    before = tiny_engine.get_internal_state()
    paused = tiny_engine.pause_generation("retract")
    assert paused.ok and paused.details["retracted"] == before["running_batch_size"] > 0
    assert tiny_engine.get_internal_state()["running_batch_size"] == 0
    res = tiny_engine.resume_memory_occupation()
    assert res.ok and not res.details["continued"], res
    st = tiny_engine.get_internal_state()
    assert st["engine_paused"] and st["memory_released"] == []
    _no_step_runs(tiny_engine, col)
    assert tiny_engine.continue_generation().ok
    got = col.wait()
    assert {k: (o.output_ids, o.logprobs) for k, o in got.items()} == want
