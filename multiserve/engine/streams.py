"""The consumer side of an engine's output: deltas in, snapshots out (no jax).

Owns `OutputAssembler`, which rebuilds each sample's cumulative `RequestOutput` from the
engine's `OutputDelta`s (the engine itself never copies a whole output), and
`OutputStream`, the per-request queue behind `Engine.open_streams` (and `Engine.stream`):
the engine thread calls `sink(delta)`; the event loop iterates the stream's deltas until
every sample sent its final one (the HTTP side consumes deltas as they are; `Engine.stream`
assembles snapshots for Python callers).

Invariants:
- The stream ends (StopAsyncIteration) right after the last sample's final output.
- Closing a stream that has not ended asks the engine to abort its rid (KV freed), even
  if it was never iterated: an object, not an async generator, so `aclose()` always runs
  its cleanup.
- `add_done_callback` callbacks run exactly once, when the stream ends or is closed.
- An assembled snapshot's output_ids/logprobs are exactly the concatenation of that
  sample's deltas so far (a delta that does not start where the last ended is a bug and
  raises).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from multiserve.types import OutputDelta, RequestOutput, TokenLogprob


class _Sample:
    __slots__ = ("ids", "logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class OutputAssembler:
    """Turns `OutputDelta`s of any number of samples into cumulative `RequestOutput`s.
    One per consumer; not thread-safe (call it from one thread)."""

    def __init__(self) -> None:
        self._samples: dict[tuple[str, int], _Sample] = {}

    def __call__(self, d: OutputDelta) -> RequestOutput:
        key = (d.rid, d.index)
        s = self._samples.get(key)
        if s is None:
            s = self._samples[key] = _Sample()
        if d.start != len(s.ids):
            raise AssertionError(f"{d.rid}[{d.index}]: delta starts at {d.start}, "
                                 f"{len(s.ids)} tokens were assembled")
        s.ids.extend(d.new_ids)
        if d.new_logprobs is not None:
            if s.logprobs is None:
                s.logprobs = []
            s.logprobs.extend(d.new_logprobs)
        if d.prompt_logprobs is not None:
            s.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            del self._samples[key]
        return RequestOutput(
            rid=d.rid, index=d.index, output_ids=tuple(s.ids), finished=d.finished,
            finish_reason=d.finish_reason, prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens, weight_version=d.weight_version,
            logprobs=None if s.logprobs is None else tuple(s.logprobs),
            prompt_logprobs=s.prompt_logprobs, weight_segments=d.weight_segments,
            matched_stop=d.matched_stop, error=d.error, spec_verify_ct=d.spec_verify_ct,
            spec_accepted_tokens=d.spec_accepted_tokens, routed_experts=d.routed_experts)


def assembling(sink: Callable[[RequestOutput], None]) -> Callable[[OutputDelta], None]:
    """A delta sink that calls `sink` with each assembled snapshot (runs where the engine
    calls it: keep `sink` cheap)."""
    assemble = OutputAssembler()
    return lambda d: sink(assemble(d))


class OutputStream:
    """Async iterator over one request's `OutputDelta`s (all samples), in engine order."""

    def __init__(self, rid: str, num_samples: int, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str], None]) -> None:
        self.rid = rid
        self._remaining = num_samples
        self._loop = loop
        self._queue: asyncio.Queue[OutputDelta] = asyncio.Queue()
        self._abort = abort
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []

    # ---- engine thread ------------------------------------------------------------------
    def sink(self, out: OutputDelta) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the consumer's loop is gone; the request is orphaned
            pass

    # ---- event loop ---------------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self._ended:
            fn()
        else:
            self._callbacks.append(fn)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                fn()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> OutputDelta:
        if self._remaining == 0 or self._ended:
            self._end()
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._remaining -= 1
            if self._remaining == 0:
                self._end()
        return out

    async def aclose(self) -> None:
        if self._remaining and not self._ended:
            self._abort(self.rid)
        self._end()
