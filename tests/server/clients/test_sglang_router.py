"""sglang-router (the Rust router on PyPI, package `sglang-router`) in front of the 4
engine ports as 4 workers, on loopback: the real router binary, started as its docs
start it (`python -m sglang_router.launch_router --worker-urls ...`). Requests go through
it unchanged: /generate and /v1/chat/completions, streaming and not. The router re-writes
each body with the fields of its own request types ("model": null, "log_metrics",
"return_hidden_states": false, "no_logs", "return_bytes", "return_entropy",
"background", "separate_reasoning", "stream_reasoning", "continue_final_message", ...):
the engines accept them.

Issue 10 item shown here: 12 (sops/multi-host-router.md has the multi-host procedure).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from client_helpers import Live

# Skips only when the router is not installed (it comes from PyPI, package `sglang-router`,
# in the `test` extra that scripts/setup.sh installs).
pytest.importorskip("sglang_router", reason="the sglang-router package (the router binary) "
                    "is not installed: run scripts/setup.sh (it is in the test extra)")

PROMPT = [1, 2040, 31, 777, 12, 9]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def router(_live: Live, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *_live.urls, "--policy", "round_robin",
           "--log-level", "warn", "--worker-startup-timeout-secs", "60"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
                if len(workers) == 4 and all(w["is_healthy"] for w in workers):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the router we started, and only it
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def forward_counts(live: Live) -> list[int]:
    return [live.state(u)["forward_ct"] for u in live.urls]


def sse(r: httpx.Response) -> list[Any]:
    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_workers_are_the_engine_ports(router: str, live: Live) -> None:
    workers = httpx.get(f"{router}/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(live.urls)
    for w in workers:  # what the router read from /server_info and /model_info
        info = live.state(w["url"])
        assert w["metadata"]["tp_size"] == "1" and w["metadata"]["dp_size"] == "1"
        assert w["metadata"]["model_path"] == info["model_path"]
        assert w["model_id"] == info["served_model_name"] == live.model_name


def test_generate_through_the_router(router: str, live: Live) -> None:
    before = forward_counts(live)
    with httpx.Client(base_url=router, timeout=120) as h:
        direct = live.http.post(f"{live.url}/generate", json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True}).json()
        outs = []
        for _ in range(4):  # round robin: one request per worker
            r = h.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12,
                                                         "temperature": 0},
                "return_logprob": True, "rid": None})
            assert r.status_code == 200, r.text
            outs.append(r.json())
        assert all(o["output_ids"] == direct["output_ids"] for o in outs)
        assert all(o["meta_info"]["output_token_logprobs"] ==
                   direct["meta_info"]["output_token_logprobs"] for o in outs)
        # slime's shape through the router (it keeps sampling_seed and no_stop_trim)
        r = h.post("/generate", headers={"X-SMG-Routing-Key": "session-1"}, json={
            "input_ids": PROMPT, "return_logprob": True, "sampling_params": {
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
                "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                "no_stop_trim": True, "spaces_between_special_tokens": False,
                "sampling_seed": 3}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 6, r.text
        # a bad constraint is still refused by name through it
        r = h.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 4, "json_schema": "{not json"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
        # a batch of token-id prompts, and streaming
        r = h.post("/generate", json={"input_ids": [PROMPT, PROMPT[:3]],
                                      "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and len(r.json()) == 2
        with h.stream("POST", "/generate", json={
                "text": "The capital of France", "stream": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) as r:
            assert r.status_code == 200
            chunks = sse(r)
        assert chunks[-1]["meta_info"]["finish_reason"] is not None
        assert len(chunks[-1]["output_ids"]) == 8
    after = forward_counts(live)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_chat_through_the_router(router: str, live: Live) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    with httpx.Client(base_url=router, timeout=120) as h:
        r = h.post("/v1/chat/completions", json={
            "model": str(live.base), "messages": messages, "max_tokens": 6,
            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        text = body["choices"][0]["message"]["content"]
        with h.stream("POST", "/v1/chat/completions", json={
                "model": "anything", "messages": messages, "max_tokens": 6, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            chunks = sse(r)
        streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c["choices"])
        assert streamed == text
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        # an error from a worker comes back through the router with its error body (the
        # router checks types itself, e.g. max_tokens >= 0; the context length is the
        # engine's to check; the router forwards max_tokens as max_completion_tokens)
        r = h.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 100_000})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_completion_tokens", r.text


def test_router_fields_are_accepted_by_the_engines(live: Live) -> None:
    """What the router adds, sent straight to an engine port (so a test failure names
    the engine, not the router)."""
    h = live.http
    r = h.post(f"{live.url}/generate", json={
        "model": None, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
        "return_hidden_states": False, "background": False, "no_logs": False,
        "return_bytes": False, "return_entropy": False})
    assert r.status_code == 200, r.text
    r = h.post(f"{live.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "model": "x", "logprobs": False,
        "max_completion_tokens": 2, "stream": False, "no_stop_trim": False,
        "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False})
    assert r.status_code == 200, r.text
    for key in ("return_hidden_states", "return_entropy", "background"):
        r = h.post(f"{live.url}/generate", json={"input_ids": PROMPT, key: True})
        assert r.status_code == 400 and r.json()["error"]["param"] == key


def test_continue_final_message(live: Live) -> None:
    """The router forwards `continue_final_message`; when true the reply continues the
    final assistant message (rendered open, no generation prompt after it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(live.base)
    messages = [{"role": "user", "content": "Say hi"},
                {"role": "assistant", "content": "Hi, I am"}]
    want = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    r = live.http.post(f"{live.url}/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "temperature": 0,
        "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
