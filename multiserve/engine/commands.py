"""The commands the engine thread runs, as typed values (no jax).

Every call into an engine from another thread is one of these, put on the engine's queue
with a future (`Engine.call(cmd) -> Future`, `await Engine.acall(cmd)`); the engine thread
runs them between two steps, in order, through one `match` (`Engine._dispatch`). The
public methods (`pause_generation`, `async_flush_cache`, the RL ones, ...) are thin
wrappers that build a command and wait for it.

Invariant: a command's fields are everything it needs; the engine thread is the only
reader of the state it touches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiserve.engine.sched.request import Req


@dataclass(frozen=True)
class Add:
    """Admit the Reqs of one request (its n samples); refused if the engine is unhealthy."""
    reqs: list[Req]


@dataclass(frozen=True)
class Abort:
    """End one request (`rid`) or every live one (`abort_all`) with finish_reason abort."""
    rid: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class Pause:
    """The user's pause (mode abort / retract / in_place; validated by the caller)."""
    mode: str


@dataclass(frozen=True)
class Continue:
    """Clear the user's pause (holds stay)."""


@dataclass(frozen=True)
class Flush:
    """Reset the prefix cache and the allocator when nothing is live."""


@dataclass(frozen=True)
class GetState:
    """`EngineCore.internal_state()`."""


@dataclass(frozen=True)
class Call:
    """Run fn(core) between two steps (the RL subsystem, tests, extensions)."""
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Stop:
    """End every live request, refuse further commands, end the engine thread."""


Command = Add | Abort | Pause | Continue | Flush | GetState | Call | Stop
