"""The fleet's front door (issue 63 item 3) on the shared 4-engine fleet: one port for every
engine, the official openai client and raw HTTP through it. Each answer is the bits its
engine's own port gives (ids and logprobs, streamed or not); sessions stick (X-Session-ID,
X-SGL-Routing-Key); a request extending a prompt follows it (prefix), a fresh one goes to
the least loaded engine; paused engines receive nothing new, and with the whole fleet
paused a request waits at the door until it resumes."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import openai
import pytest
from client_helpers import Live


@pytest.fixture()
def door(live: Live) -> str:
    url = live.fleet.front_door_url
    assert url is not None
    return url


def _chat_body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, **kw}


def _bits(answer: dict[str, Any]) -> tuple:
    c = answer["choices"][0]
    return c["message"]["content"], tuple(t["logprob"] for t in c["logprobs"]["content"])


def test_answers_are_the_engine_port_bits(live: Live, door: str) -> None:
    text = f"Name three rivers. {uuid.uuid4().hex}"
    r = live.http.post(f"{door}/v1/chat/completions", json=_chat_body(text))
    assert r.status_code == 200, r.text
    engine = int(r.headers["x-routed-engine"])
    direct = [live.http.post(f"{u}/v1/chat/completions", json=_chat_body(text)).json()
              for u in live.urls]
    assert all(_bits(d) == _bits(r.json()) for d in direct), engine
    ids = list(range(700, 740))
    gen = {"input_ids": ids, "return_logprob": True,
           "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    via = live.http.post(f"{door}/generate", json=gen).json()
    own = live.http.post(f"{live.urls[0]}/generate", json=gen).json()
    assert via["output_ids"] == own["output_ids"]
    assert via["meta_info"]["output_token_logprobs"] == own["meta_info"]["output_token_logprobs"]
    tok = {"token_ids": ids, "sampling_params": {"max_tokens": 6, "temperature": 0,
                                                 "logprobs": 0}}
    via = live.http.post(f"{door}/inference/v1/generate", json=tok).json()
    own = live.http.post(f"{live.urls[1]}/inference/v1/generate", json=tok).json()
    assert via["choices"][0]["token_ids"] == own["choices"][0]["token_ids"]


def test_openai_client_streams_through(live: Live, door: str) -> None:
    text = f"Count to five. {uuid.uuid4().hex}"
    with openai.OpenAI(base_url=f"{door}/v1", api_key="none", max_retries=0) as client:
        whole = client.chat.completions.create(
            model=live.model_name, messages=[{"role": "user", "content": text}],
            max_tokens=12, temperature=0, logprobs=True)
        stream = client.chat.completions.create(
            model=live.model_name, messages=[{"role": "user", "content": text}],
            max_tokens=12, temperature=0, logprobs=True, stream=True)
        chunks = list(stream)
        models = client.models.list()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for t in c.choices[0].logprobs.content]
    assert lps == [t.logprob for t in whole.choices[0].logprobs.content]
    assert [m.id for m in models.data][0] == live.model_name


def test_sessions_stick_and_prefixes_follow(live: Live, door: str) -> None:
    h = live.http
    for header in ("X-Session-ID", "X-SGL-Routing-Key"):
        session = f"traj-{uuid.uuid4().hex}"
        messages = [{"role": "user", "content": f"Turn one {session}"}]
        seen = []
        for turn in range(3):
            r = h.post(f"{door}/v1/chat/completions", headers={header: session},
                       json={"model": "m", "messages": messages, "max_tokens": 4,
                             "temperature": 0})
            assert r.status_code == 200, r.text
            seen.append((int(r.headers["x-routed-engine"]), r.headers["x-routing-reason"]))
            messages += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"turn {turn + 2}"}]
        assert len({e for e, _ in seen}) == 1 and [w for _, w in seen[1:]] == ["sticky"] * 2
        done = h.post(f"{door}/finish_session", params={"session_id": session}).json()
        assert done == {"success": True, "session_id": session, "released": True}
    # no session: a prompt extending an earlier one goes where that one went
    base = "Describe the water cycle in detail. " * 6 + uuid.uuid4().hex
    first = h.post(f"{door}/v1/completions", json={"prompt": base, "max_tokens": 2})
    again = h.post(f"{door}/v1/completions", json={"prompt": base + " Then rain.",
                                                   "max_tokens": 2})
    assert first.headers["x-routing-reason"] == "least_loaded"
    assert again.headers["x-routing-reason"] == "prefix"
    assert again.headers["x-routed-engine"] == first.headers["x-routed-engine"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bad = h.post(f"{door}/finish_session")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"


def test_paused_engines_get_nothing_new(live: Live, door: str) -> None:
    h = live.http
    session = f"pinned-{uuid.uuid4().hex}"
    first = h.post(f"{door}/generate", headers={"X-Session-ID": session},
                   json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    pinned = int(first.headers["x-routed-engine"])
    assert h.post(f"{live.urls[pinned]}/pause", params={"mode": "keep"}).status_code == 200
    routed = [int(h.post(f"{door}/generate", json={"text": f"q {i} {uuid.uuid4().hex}",
                                                   "sampling_params": {"max_new_tokens": 2}}
                         ).headers["x-routed-engine"]) for i in range(6)]
    moved = h.post(f"{door}/generate", headers={"X-Session-ID": session},
                   json={"text": "hello again", "sampling_params": {"max_new_tokens": 2}})
    assert pinned not in routed and int(moved.headers["x-routed-engine"]) != pinned
    assert h.get(f"{door}/routing_stats").json()["repinned_sessions"] >= 1
    health = h.get(f"{door}/health").json()
    assert health["healthy"] and not health["engines"][pinned]["accepts_work"]
    assert h.post(f"{live.urls[pinned]}/resume").status_code == 200


def test_a_request_waits_at_the_door_while_the_fleet_is_paused(live: Live, door: str) -> None:
    h = live.http
    assert h.post(f"{live.supervisor}/pause", params={"mode": "keep"}).status_code == 200
    before = sum(h.get(f"{door}/routing_stats").json()["routed"])
    out: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: out.append(h.post(
        f"{door}/generate", json={"input_ids": [5, 6, 7],
                                  "sampling_params": {"max_new_tokens": 3}})))
    worker.start()
    after = sum(h.get(f"{door}/routing_stats").json()["routed"])
    assert after == before and worker.is_alive()  # not routed: every engine is paused
    assert h.post(f"{live.supervisor}/resume").status_code == 200
    worker.join(60)
    assert out and out[0].status_code == 200 and len(out[0].json()["output_ids"]) == 3


def test_a_client_leaving_mid_stream_aborts_its_request(live: Live, door: str) -> None:
    """The stream is frozen (keep pause on its engine), then its client leaves: the front
    door closes the engine's stream, and the engine aborts the request, paused as it is."""
    h = live.http
    body = {"input_ids": [9, 8, 7, 6], "stream": True,
            "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    with h.stream("POST", f"{door}/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        engine = int(r.headers["x-routed-engine"])
        url = live.urls[engine]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert h.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200
        assert live.state(url)["running_batch_size"] == 1
    live.wait_state(lambda s: s["running_batch_size"] == 0 and s["waiting_queue_size"] == 0,
                    url)
    assert h.get(f"{door}/routing_stats").json()["in_flight"][engine] == 0
    assert h.post(f"{url}/resume").status_code == 200
