"""Sustained chat load for `multiserve bench --fleet --duration S` (jax-free).

The load of the fleet issue as a user produces it: closed-loop clients, each sending one
OpenAI chat completion after another to its port for S seconds. Request j of client i
(the same in every run, so two runs serve the same requests in the same order per client):
- the bench prompt (i + j * clients) mod P, chat-templated by the server;
- max_tokens 16, 64, 128 in turn (j mod 3), EOS honoured (answers may end early);
- temperature 0 for even i + j, else 0.8 with seed 1000 i + j (seeded: the same tokens
  on any engine, in any batch);
- streamed (with stream_options.include_usage) for odd j, else one JSON answer.

A client sends requests until S seconds have passed since the common start (at least one);
those in flight then finish. Throughput = completion tokens of every finished request /
(last finish - start): the same arithmetic for the fleet spread over its ports and for one
engine.
Every request must answer 200 with usage; anything else is an error of the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multiserve.bench.http_stream import raise_unless_ok, sse_events
from multiserve.bench.stats import percentile

MAX_TOKENS = (16, 64, 128)
SAMPLED_TEMPERATURE = 0.8


class ChatLoadError(RuntimeError):
    """A request of the sustained load failed (HTTP error, error event, no usage)."""


@dataclass(frozen=True)
class ChatRequest:
    client: int
    index: int  # j: the client's request number
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool

    def body(self, model: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model,
                               "messages": [{"role": "user", "content": self.prompt}],
                               "max_tokens": self.max_tokens, "temperature": self.temperature,
                               "stream": self.stream}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stream:
            out["stream_options"] = {"include_usage": True}
        return out


def request_of(client: int, index: int, clients: int, prompts: Sequence[str]) -> ChatRequest:
    """Request `index` of `client` among `clients` (the schedule in the module doc)."""
    sampled = (client + index) % 2 == 1
    return ChatRequest(client, index, prompts[(client + index * clients) % len(prompts)],
                       MAX_TOKENS[index % len(MAX_TOKENS)],
                       SAMPLED_TEMPERATURE if sampled else 0.0,
                       1000 * client + index if sampled else None, index % 2 == 1)


@dataclass(frozen=True)
class ChatResult:
    request: ChatRequest
    text: str
    completion_tokens: int
    sent_at: float
    first_token_at: float | None  # streamed requests only
    finished_at: float


async def _one(client: Any, url: str, model: str, req: ChatRequest) -> ChatResult:
    sent = time.perf_counter()
    endpoint = f"{url}/v1/chat/completions"
    if not req.stream:
        resp = await client.post(endpoint, json=req.body(model))
        await raise_unless_ok(resp, endpoint, ChatLoadError)
        data = resp.json()
        return ChatResult(req, data["choices"][0]["message"]["content"] or "",
                          int(data["usage"]["completion_tokens"]), sent, None,
                          time.perf_counter())
    parts: list[str] = []
    first: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", endpoint, json=req.body(model)) as resp:
        await raise_unless_ok(resp, endpoint, ChatLoadError)
        async for event in sse_events(resp, endpoint, ChatLoadError):
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
                    first = first if first is not None else time.perf_counter()
            usage = event.get("usage") or usage
    if usage is None:
        raise ChatLoadError(f"{endpoint}: the stream ended without usage")
    return ChatResult(req, "".join(parts), int(usage["completion_tokens"]), sent, first,
                      time.perf_counter())


async def _client_loop(http: Any, url: str, model: str, client: int, clients: int,
                       prompts: Sequence[str], deadline: float) -> list[ChatResult]:
    out: list[ChatResult] = []
    while True:  # at least one request
        out.append(await _one(http, url, model, request_of(client, len(out), clients, prompts)))
        if time.perf_counter() >= deadline:
            return out


async def _run(urls: Sequence[str], model: str, prompts: Sequence[str], duration_s: float
               ) -> tuple[list[ChatResult], float]:
    import httpx

    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=len(urls) + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(
            _client_loop(http, url, model, i, len(urls), prompts, t0 + duration_s)
            for i, url in enumerate(urls)))
    return [r for rs in per_client for r in rs], t0


def run_chat_load(urls: Sequence[str], model: str, prompts: Sequence[str],
                  duration_s: float) -> tuple[dict[str, Any], dict[tuple[int, int], str]]:
    """Client i on urls[i] for `duration_s`: the run's figures, and each finished
    request's text by (client, index)."""
    results, t0 = asyncio.run(_run(urls, model, prompts, duration_s))
    wall = max(r.finished_at for r in results) - t0
    tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.first_token_at - r.sent_at for r in results if r.first_token_at is not None]
    latencies = [r.finished_at - r.sent_at for r in results]
    figures = {"requests": len(results), "output_tokens": tokens, "wall_s": wall,
               "tokens_per_s": tokens / wall if wall > 0 else 0.0,
               "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
               "latency_p50_s": percentile(latencies, 50),
               "latency_p99_s": percentile(latencies, 99)}
    return figures, {(r.request.client, r.request.index): r.text for r in results}
