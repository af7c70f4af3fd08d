"""The commands the engine thread runs, as typed values (no jax).

Every call into an engine from another thread is one of these, put on the engine's queue
with a future (`Engine.call(cmd) -> Future`, `await Engine.acall(cmd)`); the engine thread
runs them between two steps, in order, through one `match` (`Engine._dispatch`). The
control operations' one-step records (multiserve/control_ops.py: PauseGeneration,
FlushCache, ReleaseMemoryOccupation, ...) are commands as they are; `Engine.control(name,
**args)` builds one and waits for it. The rest are the engine's own: admission, stop,
upkeep, and the steps of a staged weight update.

Invariant: a command's fields are everything it needs; the engine thread is the only
reader of the state it touches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multiserve.control_ops import (
    AbortRequest,
    AbortWeightUpdate,
    ContinueGeneration,
    DiscardStagedWeights,
    FinishWeightUpdate,
    FlushCache,
    GetInternalState,
    GetWeightsByName,
    ListLoraAdapters,
    PauseGeneration,
    PublishStagedWeights,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    StartWeightUpdate,
    UnloadLoraAdapter,
)

if TYPE_CHECKING:
    from multiserve.engine.base.lora_adapters import LoraAdapter
    from multiserve.engine.device.programs import ProgramKind
    from multiserve.engine.sched.request import Req


@dataclass(frozen=True)
class Add:
    """Admit the Reqs of one request (its n samples); refused if the engine is unhealthy."""
    reqs: list[Req]


@dataclass(frozen=True)
class Stop:
    """End every live request, refuse further commands, end the engine thread."""


# ---- upkeep: background compiles, integrity, tests and tools ------------------------------
@dataclass(frozen=True)
class Prime:
    """Run background-compiled program (kind, size) once on padding inputs, then let steps
    choose it (engine/device/programs.py)."""
    kind: ProgramKind
    size: int


@dataclass(frozen=True)
class CheckIntegrity:
    """`Scheduler.check_integrity()`: the page accounting (raises AssertionError)."""


@dataclass(frozen=True)
class InjectFault:
    """Tests and chaos runs: the engine's next step raises RuntimeError(message)."""
    message: str = "injected fault"


@dataclass(frozen=True)
class MarkUnhealthy:
    """The engine can no longer step (a host of its slice is lost: multiserve/multihost/):
    every live request ends with `reason` as its error and new work is refused."""
    reason: str


@dataclass(frozen=True)
class SetOverlap:
    """Benchmarks: drain, then run steps with (True) or without (False) overlap."""
    on: bool


@dataclass(frozen=True)
class SetSpeculation:
    """Benchmarks: drain, then draft from a fresh n-gram drafter (True: no memory of
    earlier requests) or run without speculative decoding (False)."""
    on: bool


@dataclass(frozen=True)
class StepInfo:
    """What the step runs on: dtype, warm-up seconds, the compiled buckets."""


@dataclass(frozen=True)
class Call:
    """Run fn(core) between two steps. Diagnostics only (tests, the bench's step-time
    breakdown): nothing in the engine, its RL subsystem or the fleet sends it."""
    fn: Callable[[Any], Any]


# ---- LoRA adapters (engine/lora_control.py): unload and list are the one-step records of
# control_ops.py; a load is read and checked off the engine thread, then this command -------
@dataclass(frozen=True)
class InstallLora:
    """A load's engine-thread step: put the checked adapter into a free slot (LoraRefused:
    name loaded, slots full); `replace`: a loaded adapter of that name is replaced
    (EngineCore.load_lora)."""
    adapter: LoraAdapter
    replace: bool = False


# ---- RL (engine/rl/): run by ControlRunner.execute on the engine thread (with the RL group's
# one-step records of control_ops.py) --------------------------------------------------------
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
class SessionToken:
    """The open weight-update session's staging token, taken for one staging (refused
    without a session, or when one checkpoint is staged already: engine/rl/session.py)."""


@dataclass(frozen=True)
class AbortSession:
    """A staging into the session failed: close it, weights unchanged, KV back."""


RLCommand = (BeginStaging | EndStaging | PublishStagedWeights | DiscardStagedWeights
             | GetWeightsByName | ReleaseMemoryOccupation | ResumeMemoryOccupation
             | StartWeightUpdate | FinishWeightUpdate | AbortWeightUpdate | SessionToken
             | AbortSession)
RL_COMMANDS = (BeginStaging, EndStaging, PublishStagedWeights, DiscardStagedWeights,
               GetWeightsByName, ReleaseMemoryOccupation, ResumeMemoryOccupation,
               StartWeightUpdate, FinishWeightUpdate, AbortWeightUpdate, SessionToken,
               AbortSession)

Command = (Add | AbortRequest | PauseGeneration | ContinueGeneration | FlushCache
           | GetInternalState | Stop | Prime | CheckIntegrity | InjectFault | MarkUnhealthy
           | SetOverlap
           | SetSpeculation | StepInfo | Call | InstallLora | UnloadLoraAdapter
           | ListLoraAdapters | RLCommand)
