"""Partial rollouts as slime, verl, ROLL and SkyRL run them (issue 49, item 3).

A rollout is interrupted (abort by rid, abort all, or a pause in abort mode), its partial
output comes back with finish reason "abort", its ids, logprobs and the weight version they
were computed with; the caller resubmits the prompt plus that partial output with the budget
left (slime: `max_new_tokens - len(partial)`). The resubmission continues bitwise as the
uninterrupted request would have:
- greedy: the same argmax over bitwise-equal logits (batch invariance: a row's logits do not
  depend on what shares its step, nor on whether its prefix came from a prompt or from decode
  steps: the same positions, the same K/V);
- seeded: every draw is keyed by (seed, sample index, sequence position), and a position is
  absolute, counted from the first prompt token; the resubmitted request has the same seed
  and sample index 0, so position p draws the same random numbers either way.
Penalties and min_new_tokens count output tokens only, so a resubmission with either does not
continue exactly (the resubmitted partial output is prompt): the tests use neither.

The interruption is made certain, not raced: the engine is paused in place once the stream has
shown a few tokens (nothing is computed while paused), then the request is aborted.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins"
BUDGET = 128  # tokens: far more than the tokens seen before the interruption
SEEN_BEFORE_PAUSE = 3

GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234}


def _body(sampling: dict[str, Any], budget: int, **inputs: Any) -> dict[str, Any]:
    return {**inputs, "return_logprob": True,
            "sampling_params": {**sampling, "max_new_tokens": budget, "ignore_eos": True}}


def _lps(out: dict[str, Any]) -> list[tuple[float, int]]:
    return [(lp, tok) for lp, tok, _ in out["meta_info"]["output_token_logprobs"]]


def _interrupted(served: Any, sampling: dict[str, Any],
                 interrupt: Callable[[httpx.Client, str], None]) -> dict[str, Any]:
    """Stream one /generate request; once it shows SEEN_BEFORE_PAUSE tokens, pause the engine
    in place, run `interrupt(http, rid)`, continue; return the final chunk."""
    rid = f"partial-{threading.get_ident()}-{id(sampling)}"
    body = {**_body(sampling, BUDGET, text=PROMPT), "rid": rid, "stream": True}
    last: dict[str, Any] = {}
    with httpx.Client(base_url=served.url, timeout=120) as h:
        with h.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            interrupted = False
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = json.loads(line[6:])
                if not interrupted and len(last["output_ids"]) >= SEEN_BEFORE_PAUSE:
                    interrupted = True
                    with httpx.Client(base_url=served.url, timeout=120) as c:
                        assert c.post("/pause_generation",
                                      json={"mode": "in_place"}).status_code == 200
                        interrupt(c, rid)
                        assert c.post("/continue_generation", json={}).status_code == 200
    return last


def _abort_rid(h: httpx.Client, rid: str) -> None:
    r = h.post("/abort_request", json={"rid": rid})
    assert r.status_code == 200 and r.json()["success"], r.text


def _abort_all(h: httpx.Client, rid: str) -> None:
    r = h.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json()["success"], r.text


def _pause_abort(h: httpx.Client, rid: str) -> None:
    # a pause in abort mode while paused in place: the user pause is already set, so the
    # request is ended by continuing and pausing again in abort mode (what SkyRL's ABORT does)
    assert h.post("/continue_generation", json={}).status_code == 200
    r = h.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200, r.text


_FULL: dict[str, dict[str, Any]] = {}  # the uninterrupted request's output, by sampling


def _full(served: Any, sampling: dict[str, Any]) -> dict[str, Any]:
    key = json.dumps(sampling, sort_keys=True)
    if key not in _FULL:
        _FULL[key] = served.http.post("/generate", json=_body(sampling, BUDGET,
                                                              text=PROMPT)).json()
    return _FULL[key]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("interrupt", [_abort_rid, _abort_all, _pause_abort],
                         ids=["abort_rid", "abort_all", "pause_abort"])
def test_partial_output_then_exact_continuation(served, idle_engine, sampling, interrupt):
    h = served.http
    full = _full(served, sampling)
    assert full["meta_info"]["finish_reason"]["type"] == "length"
    version = h.get("/get_weight_version").json()["weight_version"]

    part = _interrupted(served, sampling, interrupt)
    meta = part["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    k = len(part["output_ids"])
    assert SEEN_BEFORE_PAUSE <= k < BUDGET
    assert meta["completion_tokens"] == k
    assert meta["weight_version"] == version
    # slime polls /v1/loads?include=core until the engine is idle before resubmitting
    load = h.get("/v1/loads", params={"include": "core"}).json()
    assert sum(rank["num_total_reqs"] for rank in load["loads"]) == 0
    # the partial output is the uninterrupted request's first k tokens, logprobs bitwise
    assert part["output_ids"] == full["output_ids"][:k]
    assert _lps(part) == _lps(full)[:k]

    # slime's resubmission: the prompt's ids + the partial output, the budget left
    prompt_ids = served.tm.encode(PROMPT)
    rest = h.post("/generate", json=_body(sampling, BUDGET - k,
                                          input_ids=prompt_ids + part["output_ids"])).json()
    assert rest["meta_info"]["finish_reason"]["type"] == "length"
    assert part["output_ids"] + rest["output_ids"] == full["output_ids"]
    assert _lps(part) + _lps(rest) == _lps(full)
