"""Control over HTTP while 8 streaming clients are mid-generation, and disconnects."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

N_CLIENTS = 8
MAX_TOKENS = 16
VALID = {"stop", "length", "abort"}


def _prompts() -> list[str]:
    topics = ["rivers", "stars", "bread", "music", "trees", "trains", "snow", "cats"]
    return [f"Write a short poem about {t}." for t in topics]


async def _stream_chat(ac: httpx.AsyncClient, model: str, prompt: str, progress: asyncio.Event,
                       counts: list[int], i: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True,
            "logprobs": True}
    text, finish, rid, n_tokens = "", None, None, 0
    async with ac.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                if c.get("logprobs"):
                    n_tokens += len(c["logprobs"]["content"])
                    counts[i] = n_tokens
                    if min(counts) >= 2:
                        progress.set()
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
    return {"text": text, "finish": finish, "rid": rid, "tokens": n_tokens}


async def _run_with(served, action) -> list[dict[str, Any]]:
    """8 concurrent greedy streams; `action(http)` runs once all have 2+ tokens."""
    model = served.engine.model_name
    progress = asyncio.Event()
    counts = [0] * N_CLIENTS
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as ac:
        tasks = [asyncio.create_task(_stream_chat(ac, model, p, progress, counts, i))
                 for i, p in enumerate(_prompts())]
        if action is not None:
            await asyncio.wait_for(progress.wait(), 60)
            await action(ac)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


async def _state(ac: httpx.AsyncClient) -> dict[str, Any]:
    return (await ac.get("/get_server_info")).json()


@pytest.fixture(scope="module")
def reference(served) -> list[dict[str, Any]]:
    served.wait_state(lambda s: s["running_batch_size"] == 0 and not s["engine_paused"])
    outs = asyncio.run(_run_with(served, None))
    assert all(o["finish"] == "length" and o["tokens"] == MAX_TOKENS for o in outs)
    return outs


async def test_pause_retract_then_continue_equals_unpaused_run(served, idle_engine, reference):
    seen: dict[str, Any] = {}

    async def action(ac):
        r = await ac.post("/pause_generation", json={"mode": "retract"})
        assert r.status_code == 200 and r.json()["success"]
        st = await _state(ac)
        seen["paused_state"] = st
        # Requests are still accepted (and queued) while paused.
        r2 = await ac.post("/pause_generation", json={"mode": "retract"})
        assert r2.json()["success"] and "already" in r2.json()["message"]
        assert (await ac.post("/continue_generation")).json()["success"]

    outs = await _run_with(served, action)
    st = seen["paused_state"]
    assert st["engine_paused"] and st["running_batch_size"] == 0
    assert st["waiting_queue_size"] == N_CLIENTS
    assert [o["text"] for o in outs] == [o["text"] for o in reference]
    assert all(o["finish"] == "length" for o in outs)


async def test_pause_in_place_then_continue(served, idle_engine, reference):
    async def action(ac):
        r = await ac.post("/pause_generation", json={"mode": "in_place"})
        assert r.json()["success"]
        st = await _state(ac)
        assert st["engine_paused"] and st["running_batch_size"] + st["waiting_queue_size"] == 8
        f = await ac.post("/flush_cache")
        assert f.status_code == 400 and "cannot flush" in f.json()["message"]
        await ac.post("/continue_generation")

    outs = await _run_with(served, action)
    assert [o["text"] for o in outs] == [o["text"] for o in reference]


async def test_pause_abort_ends_every_stream(served, idle_engine):
    async def action(ac):
        r = await ac.post("/pause_generation", json={"mode": "abort"})
        assert r.json()["success"]
        st = await _state(ac)
        assert st["engine_paused"] and st["running_batch_size"] == 0
        assert st["waiting_queue_size"] == 0

    outs = await _run_with(served, action)
    assert all(o["finish"] == "abort" for o in outs)
    assert all(2 <= o["tokens"] < MAX_TOKENS for o in outs)
    # Flush succeeds once nothing is running (still paused), and says what it flushed.
    r = served.http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"]
    assert "flushed_cached_tokens" in r.json()
    served.http.post("/continue_generation")


async def test_abort_one_request_by_rid_and_then_all(served, idle_engine):
    async def action(ac):
        st = await _state(ac)
        victim = st["running_rids"][0]
        r = await ac.post("/abort_request", json={"rid": victim})
        assert r.status_code == 200 and r.json()["success"]
        unknown = await ac.post("/abort_request", json={"rid": "no-such-rid"})
        assert unknown.status_code == 200 and "no live request" in unknown.json()["message"]
        action.victim = victim

    outs = await _run_with(served, action)
    by_rid = {o["rid"]: o for o in outs}
    assert by_rid[action.victim]["finish"] == "abort"
    others = [o for o in outs if o["rid"] != action.victim]
    assert all(o["finish"] == "length" for o in others)
    assert all(o["finish"] in VALID for o in outs)

    async def abort_all(ac):
        r = await ac.post("/abort_request", json={"abort_all": True})
        assert r.json()["success"]

    outs = await _run_with(served, abort_all)
    assert all(o["finish"] == "abort" for o in outs)


def _kv_fully_free(st: dict[str, Any]) -> bool:
    return (st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0
            and st["req_to_token_pool_used"] == 0
            and st["available_kv_tokens"] + st["evictable_kv_tokens"]
            == st["initial_available_kv_tokens"])


def test_client_disconnect_mid_stream_frees_kv(served, idle_engine):
    model = served.engine.model_name
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    got += 1
                if got >= 4:
                    break
        st = served.state()
        assert st["running_batch_size"] + st["waiting_queue_size"] <= 1
    # 1500 tokens would take minutes; the abort must free everything long before.
    served.wait_state(_kv_fully_free, timeout=20)


def test_client_disconnect_non_streaming_frees_kv(served, idle_engine):
    model = served.engine.model_name
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 1500,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = served.thread.host, served.thread.port
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    served.wait_state(lambda s: s["running_batch_size"] == 1, timeout=20)
    sock.close()
    served.wait_state(_kv_fully_free, timeout=20)
