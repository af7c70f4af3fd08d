"""vLLM's pause routes on one engine's app (issue 63 item 1): POST /pause with vLLM's query
parameters, POST /resume, GET /is_paused, with vLLM's answers; AReaL's vLLM-server
spellings (/areal_pause_generation, /areal_continue_generation); bad values get a 400
with the error object. The client-framework calls (SkyRL's keep pause mid-generation,
AReaL's abort loop) are in tests/server/clients/test_skyrl.py and test_areal_vllm.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

PROMPT = [1, 77, 5021, 309, 4410, 21, 8]


def _generate(served: Any, max_new: int, out: list[Any]) -> None:
    r = served.http.post("/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    out.append(r)


def test_pause_resume_is_paused_answers(idle_engine: Any) -> None:
    h = idle_engine.http
    assert h.get("/is_paused").json() == {"is_paused": False}
    r = h.post("/pause")  # vLLM's defaults: abort, clear_cache
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    assert r.json()["mode"] == "abort" and "cleared_cached_pages" in r.json()
    assert h.get("/is_paused").json() == {"is_paused": True}
    again = h.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert again.status_code == 200 and again.json()["already_paused"] is True
    r = h.post("/resume")
    assert r.status_code == 200 and r.json()["status"] == "resumed", r.text
    assert h.get("/is_paused").json() == {"is_paused": False}


@pytest.mark.parametrize("query, param", [
    ({"mode": "later"}, "mode"), ({"mode": "KEEP"}, "mode"),
    ({"clear_cache": "maybe"}, "clear_cache"),
    ({"wait_for_inflight_requests": "2"}, "wait_for_inflight_requests")])
def test_bad_query_values_are_400_with_an_error_body(idle_engine: Any, query: dict[str, str],
                                                    param: str) -> None:
    r = idle_engine.http.post("/pause", params=query)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and param in (err.get("param") or err["message"])
    assert idle_engine.http.get("/is_paused").json() == {"is_paused": False}


def test_wait_for_inflight_requests_is_wait(idle_engine: Any) -> None:
    """The deprecated flag means mode=wait: the answer comes once the live request has
    finished, whole (its output is the unpaused one's)."""
    ref: list[Any] = []
    _generate(idle_engine, 64, ref)
    out: list[Any] = []
    worker = threading.Thread(target=_generate, args=(idle_engine, 400, out))
    start = idle_engine.state()["forward_ct"]
    worker.start()
    idle_engine.wait_state(lambda s: s["running_batch_size"] == 1
                           and s["forward_ct"] >= start + 4)
    r = idle_engine.http.post("/pause", params={"wait_for_inflight_requests": "true",
                                                "clear_cache": "false"})
    assert r.status_code == 200 and r.json()["mode"] == "wait", r.text
    assert r.json()["finished"] == 1, "the request ended before the pause arrived"
    worker.join(60)
    meta = out[0].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 400
    assert out[0].json()["output_ids"][:64] == ref[0].json()["output_ids"]
    assert idle_engine.http.get("/is_paused").json() == {"is_paused": True}
    assert idle_engine.http.post("/resume").json()["status"] == "resumed"


def test_areal_vllm_server_routes(idle_engine: Any) -> None:
    """AReaL's vLLM backend (areal/engine/vllm_remote.py) posts {} to these on every
    server; its server aborts everything and clears the cache, then resumes."""
    h = idle_engine.http
    r = h.post("/areal_pause_generation", json={})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert h.get("/is_paused").json() == {"is_paused": True}
    r = h.post("/areal_continue_generation", json={})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert h.get("/is_paused").json() == {"is_paused": False}
