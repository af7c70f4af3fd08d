"""OutputStream: one request's outputs, handed from the engine thread to an event loop.

Owns the per-request queue behind `Engine.open_streams` (and `Engine.stream`): the engine
thread calls `sink(out)`; the event loop iterates the stream until every sample sent its
final output.

Invariants:
- The stream ends (StopAsyncIteration) right after the last sample's final output.
- Closing a stream that has not ended asks the engine to abort its rid (KV freed), even
  if it was never iterated: an object, not an async generator, so `aclose()` always runs
  its cleanup.
- `add_done_callback` callbacks run exactly once, when the stream ends or is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from multiserve.types import RequestOutput


class OutputStream:
    """Async iterator over one request's `RequestOutput` snapshots (all samples)."""

    def __init__(self, rid: str, num_samples: int, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str], None]) -> None:
        self.rid = rid
        self._remaining = num_samples
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._abort = abort
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []

    # ---- engine thread ------------------------------------------------------------------
    def sink(self, out: RequestOutput) -> None:
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

    async def __anext__(self) -> RequestOutput:
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
