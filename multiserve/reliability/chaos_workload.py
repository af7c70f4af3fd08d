"""The chaos run's client side: random requests, sent and classified.

Owns `Spec` (one request: endpoint, prompt, sampling, stream, n, stop, disconnect),
`random_spec`, `send(spec)` -> `Outcome`, and the classification of every answer:
- `completed`: HTTP 200 and every choice ended with a finish reason other than abort;
- `aborted`: HTTP 200, some choice ended with finish reason abort (its partial output
  is kept);
- `refused`: an HTTP error status with an OpenAI error body (e.g. 503 while an engine
  restarts, 429 when its queue is full), or an in-band SSE error event before [DONE];
- `disconnected`: the client itself closed the stream early (on purpose);
- violations: `hung` (no answer within the timeout), `lost` (connection error),
  `dropped` (a stream that ended without `data: [DONE]` or without a final event for
  every choice), `bad_error` (an error status without the OpenAI error body).

Invariant: every request ends in exactly one outcome; `send` never raises.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = ("The capital of France is", "Once upon a time", "List three colours:",
           "def fibonacci(n):", "Tell me about the sea.", "1, 2, 3, 4,")
VIOLATIONS = ("hung", "lost", "dropped", "bad_error")


@dataclass(frozen=True)
class Spec:
    rid: str
    kind: str  # "chat" | "completions" | "native"
    prompt: str
    max_tokens: int
    stream: bool
    greedy: bool
    seed: int | None
    n: int
    stop: tuple[str, ...]
    disconnect_after: int | None  # stream events to read before leaving (None: all)

    @property
    def key(self) -> tuple[Any, ...]:
        """What a greedy answer depends on (not stream, rid or disconnection)."""
        return (self.kind, self.prompt, self.max_tokens, self.stop)


@dataclass
class Outcome:
    spec: Spec
    port: int
    started: float
    ended: float = 0.0
    kind: str = "lost"
    status: int | None = None
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    ids: dict[int, list[int]] = field(default_factory=dict)  # native: output ids
    finish: dict[int, str | None] = field(default_factory=dict)
    error: str | None = None


def random_spec(rng: random.Random, rid: str) -> Spec:
    kind = rng.choice(("chat", "chat", "completions", "native", "native"))
    stream = rng.random() < 0.5
    greedy = rng.random() < 0.7
    stop = (rng.choice(("\n", ".", " the")),) if rng.random() < 0.25 else ()
    disconnect = rng.randrange(1, 4) if stream and rng.random() < 0.1 else None
    return Spec(rid=rid, kind=kind, prompt=rng.choice(PROMPTS),
                max_tokens=rng.choice((4, 8, 16, 24, 32)), stream=stream, greedy=greedy,
                seed=None if greedy and rng.random() < 0.5 else rng.randrange(1000),
                n=rng.choice((1, 1, 1, 2, 3)), stop=stop, disconnect_after=disconnect)


def request_body(spec: Spec, model: str) -> tuple[str, dict[str, Any]]:
    temp = 0.0 if spec.greedy else 0.8
    if spec.kind == "native":
        sp: dict[str, Any] = {"max_new_tokens": spec.max_tokens, "temperature": temp,
                              "n": spec.n, "ignore_eos": True}
        if spec.seed is not None:
            sp["seed"] = spec.seed
        if spec.stop:
            sp["stop"] = list(spec.stop)
        return "/generate", {"text": spec.prompt, "rid": spec.rid, "stream": spec.stream,
                             "sampling_params": sp}
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": temp,
                            "n": spec.n, "stream": spec.stream, "rid": spec.rid,
                            "ignore_eos": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.kind == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _has_error_body(resp: httpx.Response) -> bool:
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and bool(err.get("message")) and bool(err.get("type"))


def _take_json(out: Outcome, obj: Any) -> None:
    """Record the choices of one JSON answer or stream event (all three API shapes)."""
    if isinstance(obj, list):
        for o in obj:
            _take_json(out, o)
        return
    if "meta_info" in obj:  # native: cumulative text and ids per sample
        i = int(obj.get("index", 0))
        out.texts[i] = obj.get("text", "")
        out.ids[i] = list(obj.get("output_ids", []))
        reason = obj["meta_info"].get("finish_reason")
        if reason is not None:
            out.finish[i] = reason.get("type")
        return
    for ch in obj.get("choices", []):
        i = int(ch["index"])
        piece = (ch.get("message") or ch.get("delta") or {}).get("content") \
            if "text" not in ch else ch.get("text")
        out.texts[i] = out.texts.get(i, "") + (piece or "")
        if ch.get("finish_reason") is not None:
            out.finish[i] = ch["finish_reason"]


def _finish_kind(out: Outcome) -> str:
    if len(out.finish) < out.spec.n:
        return "dropped"  # a choice without its final event
    return "aborted" if "abort" in out.finish.values() else "completed"


async def send(http: httpx.AsyncClient, base_url: str, model: str, spec: Spec,
               timeout: float) -> Outcome:
    path, body = request_body(spec, model)
    out = Outcome(spec, int(base_url.rsplit(":", 1)[1]), time.monotonic())
    try:
        if spec.stream:
            await _stream(http, base_url + path, body, out, timeout)
        else:
            resp = await http.post(base_url + path, json=body, timeout=timeout)
            out.status = resp.status_code
            if resp.status_code == 200:
                _take_json(out, resp.json())
                out.kind = _finish_kind(out)
            else:
                out.kind = "refused" if _has_error_body(resp) else "bad_error"
                out.error = resp.text[:300]
    except httpx.TimeoutException as e:
        out.kind, out.error = "hung", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        out.kind, out.error = "lost", f"{type(e).__name__}: {e}"
    out.ended = time.monotonic()
    return out


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome,
                  timeout: float) -> None:
    async with http.stream("POST", url, json=body, timeout=timeout) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            out.kind = "refused" if _has_error_body(resp) else "bad_error"
            out.error = resp.text[:300]
            return
        events, done = 0, False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if isinstance(obj, dict) and "error" in obj:
                out.kind, out.error = "refused", json.dumps(obj["error"])[:300]
                continue  # [DONE] must still follow
            _take_json(out, obj)
            events += 1
            if out.spec.disconnect_after is not None and events >= out.spec.disconnect_after:
                out.kind = "disconnected"
                return  # leaving the block closes the connection mid-stream
        if not done:
            out.kind, out.error = "dropped", "stream ended without data: [DONE]"
        elif out.kind != "refused":
            out.kind = _finish_kind(out)
