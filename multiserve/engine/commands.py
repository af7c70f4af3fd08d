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
    """The engine's internal state (engine/state_report.internal_state)."""


@dataclass(frozen=True)
class Stop:
    """End every live request, refuse further commands, end the engine thread."""


# ---- upkeep: background compiles, integrity, tests and tools ------------------------------
@dataclass(frozen=True)
class Prime:
    """Run background-compiled program (kind "T" / "R", size) once on padding inputs, then
    let steps choose it (engine/device/programs.py)."""
    kind: str
    size: int


@dataclass(frozen=True)
class CheckIntegrity:
    """`Scheduler.check_integrity()`: the page accounting (raises AssertionError)."""


@dataclass(frozen=True)
class InjectFault:
    """Tests and chaos runs: the engine's next step raises RuntimeError(message)."""
    message: str = "injected fault"


@dataclass(frozen=True)
class SetOverlap:
    """Benchmarks: drain, then run steps with (True) or without (False) overlap."""
    on: bool


@dataclass(frozen=True)
class StepInfo:
    """What the step runs on: dtype, warm-up seconds, the compiled buckets."""


@dataclass(frozen=True)
class Call:
    """Run fn(core) between two steps. Diagnostics only (tests, the bench's step-time
    breakdown): nothing in the engine, its RL subsystem or the fleet sends it."""
    fn: Callable[[Any], Any]


# ---- RL (engine/rl/): run by RLControl.execute on the engine thread ----------------------
@dataclass(frozen=True)
class BeginStaging:
    """Hold the engine for a weight staging (refused while requests run, unless
    abort_running); details["token"] names the staging."""
    abort_running: bool = False


@dataclass(frozen=True)
class EndStaging:
    """A staging that failed or was interrupted ends its own hold (token), not another's."""
    token: str


@dataclass(frozen=True)
class Publish:
    """Swap staged weights `token` in, set their version, invalidate the prefix cache."""
    token: str
    abort_running: bool = False


@dataclass(frozen=True)
class Discard:
    """Drop staged weights (`token`, or whichever are staged) and end their hold."""
    token: str | None = None


@dataclass(frozen=True)
class ReadWeights:
    """One tensor's first `truncate_size` rows (HF name and orientation)."""
    name: str
    truncate_size: int = 100


@dataclass(frozen=True)
class ReleaseMemory:
    """Hold the engine (applying `mode` if it runs), then free the tagged device buffers."""
    tags: tuple[str, ...]
    mode: str = "retract"
    preserve_state: bool = False


@dataclass(frozen=True)
class ResumeMemory:
    """Bring the tagged device buffers back; the hold ends once all are resident."""
    tags: tuple[str, ...]


RLCommand = (BeginStaging | EndStaging | Publish | Discard | ReadWeights | ReleaseMemory
             | ResumeMemory)
RL_COMMANDS = (BeginStaging, EndStaging, Publish, Discard, ReadWeights, ReleaseMemory,
               ResumeMemory)

Command = (Add | Abort | Pause | Continue | Flush | GetState | Stop | Prime | CheckIntegrity
           | InjectFault | SetOverlap | StepInfo | Call | RLCommand)
