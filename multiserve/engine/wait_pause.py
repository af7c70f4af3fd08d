"""A "wait" pause in progress (vLLM's `mode=wait`), and control answers that come later
(no jax).

`WaitPause`: admission is closed (the scheduler admits only the Reqs live when the pause
began); once every one of them has finished, the engine core sets the user's pause and
answers. `Pending`: the answer of a command the engine thread gives after the command
has run (`Engine._run_command` hands the command's future to it).

Invariants: only the engine thread creates, settles or cancels them (EngineCore owns the
one WaitPause); a Pending is resolved exactly once, and every callback attached before or
after that gets the one result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from multiserve.engine.sched.request import Req
from multiserve.types import ControlResult


class Pending:
    """A ControlResult to come."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[ControlResult], None]] = []
        self._result: ControlResult | None = None

    def then(self, callback: Callable[[ControlResult], None]) -> None:
        if self._result is not None:
            callback(self._result)
        else:
            self._callbacks.append(callback)

    def resolve(self, result: ControlResult) -> None:
        assert self._result is None, "a pending answer is resolved once"
        self._result = result
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(result)


class WaitPause:
    """The requests a "wait" pause lets finish first, and who waits for its answer."""

    def __init__(self, live: Iterable[Req], clear_cache: bool) -> None:
        self.live = tuple(live)
        self.clear_cache = clear_cache
        self.answer = Pending()

    def join(self, clear_cache: bool) -> Pending:
        """Another "wait" pause while this one drains: the same answer (the cache is
        cleared if either asked)."""
        self.clear_cache = self.clear_cache or clear_cache
        return self.answer

    @property
    def drained(self) -> bool:
        return all(r.finished for r in self.live)
