"""The sustained chat load's client (multiserve/bench/chat_load.py): its fixed request
schedule, and that a failing server fails the run with the reason (a real HTTP server on
loopback answering what a broken engine would). The load against real engines runs in
test_bench_fleet.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from multiserve.bench.chat_load import ChatLoadError, request_of, run_chat_load

PROMPTS = [f"prompt {i}" for i in range(10)]


def test_schedule_mixes_lengths_sampling_and_streaming() -> None:
    reqs = [request_of(c, j, 4, PROMPTS) for c in range(4) for j in range(6)]
    assert {r.max_tokens for r in reqs} == {16, 64, 128}
    assert [request_of(0, j, 4, PROMPTS).max_tokens for j in range(4)] == [16, 64, 128, 16]
    assert [r.stream for r in reqs].count(True) == len(reqs) // 2
    for r in reqs:
        assert (r.temperature == 0.0) == (r.seed is None)  # sampled requests are seeded
    assert len({r.seed for r in reqs if r.seed is not None}) == len(reqs) // 2
    # client i's request j uses prompt (i + 4 j) mod 10: clients start on different prompts
    assert [request_of(c, 0, 4, PROMPTS).prompt for c in range(4)] == PROMPTS[:4]
    assert request_of(1, 2, 4, PROMPTS).prompt == PROMPTS[9]
    assert request_of(2, 3, 5, PROMPTS) == request_of(2, 3, 5, PROMPTS)  # fixed
    body = request_of(0, 1, 4, PROMPTS).body("m")
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["seed"] == 1 and body["temperature"] == 0.8 and body["max_tokens"] == 64
    assert "seed" not in request_of(0, 0, 4, PROMPTS).body("m")


class _Broken(BaseHTTPRequestHandler):
    """Answers a JSON chat request 400 with an error body, a streamed one with an event
    stream that ends without usage."""

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body["stream"]:
            payload = json.dumps({"error": {"message": "max_tokens too large"}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        event = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        payload = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def broken_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_error_fails_the_run_with_its_body(broken_url: str) -> None:
    with pytest.raises(ChatLoadError, match="HTTP 400.*max_tokens too large"):
        run_chat_load([broken_url], "m", PROMPTS, 0.0)  # request 0: not streamed


def test_a_stream_without_usage_fails_the_run(broken_url: str) -> None:
    # every client's first request is a JSON one (which this server fails): send a
    # streamed request (j = 1) alone
    import asyncio

    import httpx

    from multiserve.bench.chat_load import _one

    async def go() -> None:
        async with httpx.AsyncClient(trust_env=False) as http:
            await _one(http, broken_url, "m", request_of(0, 1, 1, PROMPTS))

    with pytest.raises(ChatLoadError, match="without usage"):
        asyncio.run(go())
