"""One streaming benchmark client: POST /generate (sglang-native) with token ids and
`stream: true`, timing each server-sent event as it arrives (jax-free); and the event
stream reading it shares with the chat load (chat_load.py): status check, SSE events.

Every event carries the output ids so far (cumulative), so the token count is the
length of the last event's `output_ids`; a `meta_info.finish_reason` marks the end. An
error event, a non-200 answer or a stream that ends without a finish is an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from multiserve.bench.stats import Timeline


class StreamError(RuntimeError):
    """A benchmark stream failed (HTTP error, error event, or no finish)."""


def generate_body(ids: Sequence[int], output_len: int) -> dict[str, Any]:
    """The /generate body: greedy, exactly `output_len` tokens (EOS ignored), streamed."""
    return {"input_ids": [int(t) for t in ids], "stream": True,
            "sampling_params": {"max_new_tokens": int(output_len), "temperature": 0.0,
                                "ignore_eos": True}}


async def raise_unless_ok(resp: Any, where: str, error: type[Exception]) -> None:
    """Raise `error` (naming `where`, the status and the body's start) unless `resp` (an
    httpx streaming response) answered 200."""
    if resp.status_code != 200:
        text = (await resp.aread()).decode(errors="replace")[:300]
        raise error(f"{where}: HTTP {resp.status_code}: {text}")


async def sse_events(resp: Any, where: str, error: type[Exception]
                     ) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of the server-sent event stream `resp` up to `data: [DONE]`; an
    error event raises `error` naming `where`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise error(f"{where}: error event: {event['error']}")
        yield event


async def stream_generate(client: Any, url: str, ids: Sequence[int], output_len: int
                          ) -> Timeline:
    """Stream one request to `url` (an engine's base URL) with `client` (an
    httpx.AsyncClient); returns its timeline (perf_counter times, output ids)."""
    tl = Timeline()
    async with client.stream("POST", f"{url}/generate",
                             json=generate_body(ids, output_len)) as resp:
        await raise_unless_ok(resp, f"{url}/generate", StreamError)
        async for event in sse_events(resp, f"{url}/generate", StreamError):
            now = time.perf_counter()
            out = event.get("output_ids") or []
            tl.record(now, len(out))
            meta = event.get("meta_info") or {}
            if meta.get("finish_reason") is not None:
                tl.finished_at = now
                tl.finish_reason = str(meta["finish_reason"].get("type"))
                tl.output_ids = tuple(out)
    if tl.finished_at is None:
        raise StreamError(f"{url}/generate: the stream ended without a finish")
    return tl
