"""Overload: admission beyond the waiting-queue bounds is refused with 429 (sample count)
or 503 (queued KV tokens), an OpenAI error body naming the bound, and Retry-After; what
was accepted is never dropped, and the queue never grows past its bound.

One tiny engine behind a real server on loopback; the engine is paused in place, so
requests pile up in the waiting queue exactly as under a burst the engine cannot absorb.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from loopback_server import engine_server

MAX_QUEUED = 8
MAX_QUEUED_TOKENS = 1000
PROMPT_IDS = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[str]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.reliability.tiny_model import tiny_engine_fields

    engine = Engine(EngineConfig(model_path=str(tiny_model), **tiny_engine_fields(
        max_queued_requests=MAX_QUEUED, max_queued_tokens=MAX_QUEUED_TOKENS)))
    with engine_server(engine) as url:
        yield url
    engine.shutdown()


def gen_body(max_new: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT_IDS, "stream": False, **extra,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                "ignore_eos": True, **extra.pop("sp", {})}}


def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    assert int(r.headers["retry-after"]) >= 1, r.headers


async def test_overload_is_refused_with_reason_and_retry_after(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=120) as http:
        async def queued() -> int:
            info = (await http.get("/get_server_info")).json()
            assert info["max_queued_requests"] == MAX_QUEUED
            return info["waiting_queue_size"]

        async def wait_queued(n: int) -> None:
            for _ in range(400):
                if await queued() == n:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"queue never reached {n}: {await queued()}")

        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code \
            == 200
        accepted = [asyncio.ensure_future(http.post("/generate", json=gen_body(200)))
                    for _ in range(4)]  # 4 x 205 = 820 queued KV tokens
        await wait_queued(4)
        # the KV-token bound: 820 + 205 > 1000
        r = await http.post("/generate", json=gen_body(200))
        assert_refused(r, 503, "kv_overloaded")
        assert "max_queued_tokens" in r.json()["error"]["message"]
        # small requests still fit the token bound, until the count bound is reached
        accepted += [asyncio.ensure_future(http.post("/generate", json=gen_body(10)))
                     for _ in range(MAX_QUEUED - 4)]
        await wait_queued(MAX_QUEUED)
        for body in (gen_body(1), gen_body(1, stream=True), gen_body(1, sp={"n": 2})):
            r = await http.post("/generate", json=body)
            assert_refused(r, 429, "queue_full")
            assert "max_queued_requests" in r.json()["error"]["message"]
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        r = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT_IDS,
                                                     "max_tokens": 1})
        assert_refused(r, 429, "queue_full")
        assert await queued() == MAX_QUEUED  # the bound held; nothing was queued past it
        assert (await http.post("/continue_generation")).status_code == 200
        answers = await asyncio.gather(*accepted)
        assert [a.status_code for a in answers] == [200] * MAX_QUEUED  # nothing dropped
        assert all(a.json()["meta_info"]["finish_reason"]["type"] == "length" for a in answers)
        assert (await http.get("/health")).json()["status"] == "ok"
        # with the queue drained, the same request is admitted again
        r = await http.post("/generate", json=gen_body(200))
        assert r.status_code == 200, r.text
