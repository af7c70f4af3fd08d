"""Pause reasons (issue 12): a user's pause survives every hold (weights staged, memory
released), and a user pause taken while a hold is active takes effect (retract retracts).

The engine is paused while its set of pause reasons is non-empty; each subsystem adds and
removes only its own reason ("user", "weights_staged", "memory_released").
"""

from __future__ import annotations

import itertools
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


def test_user_retract_during_release_retracts_and_survives_resume(
        tiny_engine: Any, trigger: Trigger) -> None:
    col0 = Collector(tiny_engine)
    col0.submit_all(_prompts(), GREEDY)
    want = {k: (o.output_ids, o.logprobs) for k, o in col0.wait().items()}
    hook = AtTokens(trigger, "r0", 4, lambda: tiny_engine.acontrol(
        "release_memory_occupation", mode="in_place", preserve_state=True))
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


# ---- the matrix: a user pause (each mode) x one hold, in every overlapping order ----------
#
# Events: H = the hold starts, P = pause_generation(mode), E = the hold ends, C =
# continue_generation. The first event lands from a sink hook while requests run (r0 has
# 4 tokens); the others come from the test thread. After every event the reasons are
# exactly the model's; a request sent after the second event makes no progress until
# the last one; every request of the workload ends as it would have without any pause
# (or aborted with a prefix of it: mode abort, or a weight update begun while they ran,
# which needs abort_running and so aborts them first as sglang does).

HOLD_REASON = {"publish": "weights_staged", "discard": "weights_staged",
               "release_in_place": "memory_released", "release_retract": "memory_released"}
ORDERS = ("HPEC", "HPCE", "PHEC", "PHCE")


@pytest.fixture(scope="module")
def reference(_tiny_engine: Any) -> dict:
    col = Collector(_tiny_engine)
    col.submit_all(_prompts(), GREEDY)
    return {k: (o.output_ids, o.logprobs) for k, o in col.wait().items()}


class _Hold:
    """Start and end one hold of `kind` (see HOLD_REASON) on `engine`."""

    def __init__(self, engine: Any, kind: str, model_dir: Path,
                 abort_running: bool = False) -> None:
        self.engine, self.kind, self.model_dir = engine, kind, model_dir
        self.abort_running = abort_running
        self.token: str | None = None

    def astart(self) -> Any:
        """The start as a coroutine (for a sink hook)."""
        return self._start(self.engine.acontrol)

    def start(self) -> Any:
        return self._start(self.engine.control)

    def _start(self, run: Any) -> Any:
        if self.kind in ("publish", "discard"):  # the same weights: outputs stay exact
            return run("stage_weights_from_disk", path=str(self.model_dir),
                       weight_version="default", abort_running=self.abort_running)
        if self.kind == "release_in_place":
            return run("release_memory_occupation", mode="in_place", preserve_state=True)
        return run("release_memory_occupation")

    def started(self, res: Any) -> None:
        assert res.ok, res
        self.token = res.details.get("token")

    def end(self, runs_after: bool) -> None:
        e = self.engine
        if self.kind == "publish":
            res = e.publish_staged_weights(self.token)
            assert res.ok and res.details["released_hold"] == runs_after, res
        elif self.kind == "discard":
            res = e.discard_staged_weights(self.token)
            assert res.ok and res.details["released_hold"] == runs_after, res
        else:
            res = e.resume_memory_occupation()
            assert res.ok and res.details["continued"] == runs_after, res


def _check_reasons(engine: Any, want: set[str]) -> dict:
    st = engine.get_internal_state()
    assert st["pause_reasons"] == sorted(want), (st["pause_reasons"], want)
    assert st["engine_paused"] == bool(want)
    return st


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("hold", list(HOLD_REASON))
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_user_pause_and_hold_in_any_order(tiny_engine: Any, trigger: Trigger,
                                          tiny_model_dir: Path, reference: dict,
                                          mode: str, hold: str, order: str) -> None:
    first = order[0]
    # a weight update while requests run needs abort_running, which aborts every started
    # request first (sglang's abort_all_requests); once the user paused it is not needed
    h = _Hold(tiny_engine, hold, tiny_model_dir, abort_running=first == "H")
    reason = HOLD_REASON[hold]
    aborted_by_hold = first == "H" and reason == "weights_staged"
    hook = AtTokens(trigger, "r0", 4, lambda: tiny_engine.acontrol("get_internal_state"),
                    h.astart if first == "H" else
                    (lambda: tiny_engine.acontrol("pause_generation", mode=mode)))
    col = Collector(tiny_engine, on_output=hook)
    col.submit_all(_prompts(), GREEDY)
    state_before, res = hook.wait()
    want: set[str] = set()
    for i, event in enumerate(order):
        if i > 0:
            state_before = tiny_engine.get_internal_state()
        if event == "H":
            h.started(res if i == 0 else h.start())
            want.add(reason)
        elif event == "P":
            if i > 0:
                res = tiny_engine.pause_generation(mode)
            assert res.ok and not res.details.get("already_paused"), res
            want.add("user")
            _check_mode_effect(tiny_engine, mode, state_before, res)
        elif event == "E":
            want.discard(reason)
            h.end(runs_after=not want)
        else:
            want.discard("user")
            assert tiny_engine.continue_generation().ok
        _check_reasons(tiny_engine, want)
        if i == 1:
            col.submit("late", _prompts(seed=4, n=1)[0], LATE)
        if i in (1, 2):
            _no_step_runs(tiny_engine, col)
            assert ("late", 0) not in col.snapshots
    got = col.wait()
    assert got.pop(("late", 0)).finish_reason == "length"
    assert set(got) == set(reference)
    for key, out in got.items():
        ids, lps = reference[key]
        if mode == "abort" or aborted_by_hold:
            n = len(out.output_ids)
            assert out.finish_reason == "abort" and (out.output_ids, out.logprobs) == \
                (ids[:n], lps[:n]), key
        else:
            assert (out.output_ids, out.logprobs) == (ids, lps), key
    assert tiny_engine.get_internal_state()["weight_version"] == "default"


def _check_mode_effect(engine: Any, mode: str, before: dict, res: Any) -> None:
    """The user's pause took effect, whatever hold was active."""
    after = engine.get_internal_state()
    if mode == "abort":
        assert res.details["aborted"] == before["running_batch_size"] + \
            before["waiting_queue_size"]
        assert after["running_batch_size"] == after["waiting_queue_size"] == 0
    elif mode == "retract":
        assert res.details["retracted"] == before["running_batch_size"]
        assert after["running_batch_size"] == 0
        assert after["waiting_rids"][:len(before["running_rids"])] == before["running_rids"]
    else:
        assert after["running_rids"] == before["running_rids"]
        assert after["waiting_rids"] == before["waiting_rids"]


# ---- all three owners at once: every interleaving of their starts and ends ----------------
#
# U = the user (pause in_place / continue), W = a weight update (stage / publish or
# discard), M = a memory release of the KV cache (release / resume). Each appears twice in
# a sequence: first its start, then its end. A request sent after the first event runs iff
# no reason is left.

OWNERS = {"U": "user", "W": "weights_staged", "M": "memory_released"}


def _interleavings() -> list[str]:
    return sorted({"".join(p) for p in itertools.permutations("UUWWMM")})


@pytest.mark.parametrize("weights_end", ["publish", "discard"])
@pytest.mark.parametrize("seq", _interleavings())
def test_three_owners_in_every_order(tiny_engine: Any, original_norm: Any, seq: str,
                                     weights_end: str) -> None:
    e = tiny_engine
    col = Collector(e)
    want: set[str] = set()
    token = None
    late_done = False
    for i, owner in enumerate(seq):
        starts = OWNERS[owner] not in want
        if owner == "U":
            res = e.pause_generation("in_place") if starts else e.continue_generation()
        elif owner == "W" and starts:
            res = e.stage_weights_from_tensor({"model.norm.weight": original_norm}, "default")
            token = res.details.get("token")
        elif owner == "W":
            res = (e.publish_staged_weights(token) if weights_end == "publish"
                   else e.discard_staged_weights(token))
        else:
            res = (e.release_memory_occupation(tags=["kv_cache"]) if starts
                   else e.resume_memory_occupation(tags=["kv_cache"]))
        assert res.ok, (seq, i, res)
        (want.add if starts else want.discard)(OWNERS[owner])
        _check_reasons(e, want)
        if i == 0:
            col.submit("late", _prompts(seed=5, n=1)[0], LATE)
        if want:
            assert late_done or ("late", 0) not in col.final
        elif not late_done:  # nothing holds the engine: the request runs (and ends) now
            assert col.wait()[("late", 0)].finish_reason == "length"
            late_done = True
    assert late_done


@pytest.fixture(scope="module")
def original_norm(tiny_model_dir: Path) -> Any:
    """The served model's final norm (HF name model.norm.weight): staging it changes no
    output."""
    import numpy as np

    from multiserve.model.loading.loader import load_model

    return np.asarray(load_model(str(tiny_model_dir), np.float32).params["final_norm"])


async def test_server_info_shows_the_reasons(tiny_engine: Any, tiny_model_dir: Path) -> None:
    import httpx

    from multiserve.server.app import build_app
    from multiserve.server.tokenizer import TokenizerManager

    app = build_app(tiny_engine, TokenizerManager(tiny_model_dir, context_len=1024,
                                                  model_name="tiny"))
    staged = await tiny_engine.acontrol("stage_weights_from_disk", path=str(tiny_model_dir),
                                       weight_version="default")
    assert staged.ok, staged
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as http:
            assert (await http.post("/pause_generation", json={"mode": "in_place"})
                    ).status_code == 200
            info = (await http.get("/get_server_info")).json()
            assert info["engine_paused"] and info["pause_reasons"] == ["user",
                                                                       "weights_staged"]
            assert info["internal_states"][0]["pause_reasons"] == info["pause_reasons"]
            doc = (await http.get("/openapi.json")).json()
            ok = doc["paths"]["/get_server_info"]["get"]["responses"]["200"]
            props = ok["content"]["application/json"]["schema"]["properties"]
            assert props["pause_reasons"]["items"]["enum"] == [
                "user", "weights_staged", "memory_released"]
    finally:
        await tiny_engine.acontrol("discard_staged_weights")
        await tiny_engine.acontrol("continue_generation")
    assert tiny_engine.get_internal_state()["pause_reasons"] == []
