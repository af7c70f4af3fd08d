"""One engine request seen from the HTTP side: per-sample text events.

Owns: `RequestRun`, which submits a `GenerateRequest` through
`EngineClient.open_streams`, consumes the engine's `OutputDelta`s as they come (no
cumulative copy), detokenizes each sample incrementally (showing the engine's stop-string
verdict) and yields `SampleEvent`s; `merge_runs` for several prompts at once;
`until_disconnect` for non-streaming requests whose client may go away.

Invariants:
- The engine stream is always closed when the run ends for any reason (done, error,
  cancellation on client disconnect): closing it aborts whatever is still running in the
  engine and frees its KV. The close is shielded from cancellation so a disconnect can
  never skip it.
- Each sample ends exactly once, on its final delta; a delta must start where the
  previous one of its sample ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from multiserve.server.detokenizer import IncrementalDetokenizer
from multiserve.server.http_utils import api_error_from
from multiserve.server.tokenizer import TokenizerManager
from multiserve.types import (
    EngineClient,
    GenerateRequest,
    InvalidRequest,
    OutputDelta,
    RoutedExperts,
    TokenLogprob,
)

T = TypeVar("T")


@dataclass
class SampleState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    done: bool = False
    spec_verify_ct: int = 0  # speculative decoding: verify steps, accepted draft tokens
    spec_accepted_tokens: int = 0
    routed_experts: RoutedExperts | None = None  # from the final delta (when asked)

    @property
    def text(self) -> str:
        return self.detok.text


@dataclass(frozen=True)
class SampleEvent:
    index: int
    text: str  # newly emitted text
    token_ids: list[int]  # newly consumed tokens
    logprobs: list[TokenLogprob]  # their logprobs (empty unless requested)
    finished: bool
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class RequestRun:
    """Drives one GenerateRequest; iterate `events()` once."""

    def __init__(self, engine: EngineClient, tm: TokenizerManager, request: GenerateRequest,
                 on_done: Callable[[RequestRun], None] | None = None,
                 fields: Mapping[str, str] | None = None) -> None:
        """`fields`: the client's name for each engine field a refusal may name
        (types.InvalidRequest.param), e.g. input_ids -> prompt for the OpenAI API."""
        self.engine = engine
        self.request = request
        self.fields = dict(fields or {})
        sp = request.sampling
        self.samples = [
            SampleState(i, tm.detokenizer(stop=sp.stop, skip_special_tokens=sp.skip_special_tokens,
                                          prompt_ids=request.input_ids,
                                          no_stop_trim=sp.no_stop_trim))
            for i in range(sp.n)]
        self.prompt_tokens = len(request.input_ids)
        self.cached_tokens = 0
        self.weight_version = ""
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.weight_segments: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self._on_done = on_done
        self._stream: AsyncIterator[OutputDelta] | None = None

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def e2e_latency(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started

    async def start(self) -> None:
        """Submit now (see `start_runs`): a refusal (engine unavailable or draining,
        invalid request) raises here, before any HTTP response has begun."""
        await start_runs([self])

    async def _close_stream(self) -> None:
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _outputs(self) -> AsyncIterator[OutputDelta]:
        if self._stream is None:
            await self.start()
        assert self._stream is not None
        async for out in self._stream:
            yield out

    async def events(self) -> AsyncIterator[SampleEvent]:
        stream = self._outputs()
        try:
            async for out in stream:
                if not 0 <= out.index < len(self.samples):
                    continue
                st = self.samples[out.index]
                if st.done:
                    continue
                self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
                self.weight_version = out.weight_version
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.weight_segments:
                    self.weight_segments = [{"start": w.start, "weight_version": w.weight_version}
                                            for w in out.weight_segments]
                event = self._advance(st, out)
                if event is not None:
                    yield event
                if all(s.done for s in self.samples):
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            if self._stream is not None:
                await self._close_stream()
            self.ended_at = time.monotonic()
            for st in self.samples:
                if not st.done:  # cancelled / engine stream ended early
                    st.done, st.finish_reason = True, "abort"
            if self._on_done is not None:
                self._on_done(self)

    def _trims_stop_token(self, out: OutputDelta) -> bool:
        m = out.matched_stop
        return (out.finished and out.finish_reason == "stop" and isinstance(m, int)
                and not isinstance(m, bool) and not self.request.sampling.no_stop_trim)

    def _advance(self, st: SampleState, out: OutputDelta) -> SampleEvent | None:
        assert out.start == len(st.token_ids), "a delta must start where the last ended"
        new_ids = list(out.new_ids)
        pieces: list[str] = []
        # sglang trims a matched stop TOKEN (eos or stop_token_ids) from the text, unless
        # no_stop_trim; output_ids keep it either way.
        trim = self._trims_stop_token(out) and bool(new_ids)
        pieces.append(st.detok.add_tokens(new_ids[:-1] if trim else new_ids))
        st.token_ids.extend(new_ids)
        st.spec_verify_ct, st.spec_accepted_tokens = out.spec_verify_ct, out.spec_accepted_tokens
        new_lps = list(out.new_logprobs or ())
        st.logprobs.extend(new_lps)
        if new_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if out.finished:
            # the engine decided any stop string (engine/base/stop_strings.py); the text follows
            matched = out.matched_stop if isinstance(out.matched_stop, str) else None
            pieces.append(st.detok.finish(matched))
            st.done, st.finish_reason = True, out.finish_reason or "stop"
            st.matched_stop, st.error = out.matched_stop, out.error
            st.routed_experts = out.routed_experts
        text = "".join(pieces)
        if not (text or new_ids or st.done):
            return None
        return SampleEvent(st.index, text, new_ids, new_lps, st.done,
                           st.finish_reason if st.done else None,
                           st.matched_stop if st.done else None)


async def start_runs(runs: list[RequestRun]) -> None:
    """Submit every run not started yet in ONE engine command (`EngineClient.open_streams`):
    a batch is admitted atomically, all queued before the engine's next step, so a pause or
    abort that follows sees all of it. If the engine refuses one, none is admitted and the
    refusal raises."""
    todo = [r for r in runs if r._stream is None]
    if not todo:
        return
    try:
        streams = await todo[0].engine.open_streams([r.request for r in todo])
    except InvalidRequest as exc:  # the engine's check, in the client's field names
        raise api_error_from(exc, todo[0].fields) from None
    for run, st in zip(todo, streams, strict=True):
        run._stream = st


async def merge_runs(runs: list[RequestRun]) -> AsyncIterator[tuple[int, SampleEvent]]:
    """Events of several runs as (run index, event), in arrival order."""
    if len(runs) == 1:
        async for ev in runs[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, SampleEvent | None | BaseException]] = asyncio.Queue()

    async def pump(i: int, run: RequestRun) -> None:
        try:
            async for ev in run.events():
                await queue.put((i, ev))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        live = len(runs)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next receive() only returns on disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():  # we ourselves were cancelled
            task.cancel()
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def finish_runs(request: Request, runs: list[RequestRun]) -> None:
    """Run every request to its end for a non-streaming response. Engine-side failures
    become `ApiError`s (503 unavailable, 400 rejected); a client that leaves aborts them."""
    try:
        await until_disconnect(request, drain_all(runs))
    except ClientDisconnected:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error
        raise api_error_from(exc) from exc


async def drain(run: RequestRun) -> None:
    async for _ in run.events():
        pass


async def drain_all(runs: list[RequestRun]) -> None:
    await start_runs(runs)
    async for _ in merge_runs(runs):
        pass
