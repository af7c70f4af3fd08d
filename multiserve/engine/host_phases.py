"""HostPhases: where the engine thread's time goes, phase by phase, step pass by pass.

A measuring aid (`multiserve bench --host-phases`, docs/performance.md §23): while an
EngineCore holds one (`EngineCore.host_phases`, None by default: then the step path
calls `NO_PHASES`, whose every call does nothing), every pass of `EngineCore.step` is
cut into consecutive phases by `lap(phase)`, each charged the time since the lap before
it; `timed(phase, fn, ...)` wraps a room's call: `fn(...)`, then `lap(phase)`:

- loop: from the end of the previous pass to the start of this one (the engine loop:
  its command queue, `has_work`);
- schedule: `Scheduler.schedule` (and a drain the step needed first, in its own phases);
- inputs: `StepInputs.build` (engine/step_inputs/device_step.py: the token arrays, the
  page table, the sampler's rows);
- launch: `Device.run` (packing the inputs and calling the compiled programs);
- advance: `Scheduler.launch` (positions, pending tokens, the prefix cache);
- read_back: reading the sampled ids to the host: the one phase that waits on the
  device (with overlap, for the step launched one pass before);
- postprocess: the logprobs, routed experts and `Scheduler.postprocess` (tokens, stop
  rules, finishing);
- deliver: `EngineCore._deliver` of every request with output (its sink: a stream's
  queue, the bench's timeline).

Host time of a pass = its wall time less `read_back`; per decode step, a decode pass's
host time over the decode steps its launched step ran (EngineConfig
.decode_steps_per_dispatch: K per dispatch where the step runs K). Passes are split into decode
passes (the step launched and the step read are both pure decode steps, or absent)
and the others (with a prefill chunk), reported apart.

Invariant: the phases of a pass tile it: the sum of a pass's phases is its wall time
from the end of the previous pass (`loop` included) to its own end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np

PHASES = ("loop", "schedule", "inputs", "launch", "advance", "read_back", "postprocess",
          "deliver")
WAIT_PHASES = ("read_back",)  # waiting on the device, not host work
_INDEX = {name: i for i, name in enumerate(PHASES)}
P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class HostPhases:
    """Per-pass phase times (seconds) of one engine's step passes, decode and other."""

    decode: list[list[float]] = field(default_factory=list)
    other: list[list[float]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # decode passes: rows launched
    # decode passes: decode steps the launched step ran (EngineConfig
    # .decode_steps_per_dispatch; 1 for a pass that launched none)
    decode_steps: list[int] = field(default_factory=list)
    _current: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    _last: float | None = None  # perf_counter of the last lap (None: no pass yet)
    _is_decode: bool = True
    _rows: int = 0
    _decode_steps: int = 1

    def start(self) -> None:
        """A pass begins: the time since the previous pass ended is its `loop` phase."""
        now = time.perf_counter()
        self._current = [0.0] * len(PHASES)
        if self._last is not None:
            self._current[0] = now - self._last
        self._last = now
        self._is_decode = True
        self._rows = 0
        self._decode_steps = 1

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to `phase`."""
        now = time.perf_counter()
        assert self._last is not None, "lap before start"
        self._current[_INDEX[phase]] += now - self._last
        self._last = now

    def timed(self, phase: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)`, then `lap(phase)`: its time (and what ran since the
        last lap) charged to `phase`."""
        out = fn(*args, **kwargs)
        self.lap(phase)
        return out

    def saw(self, decode_only: bool, rows: int = 0, decode_steps: int = 1) -> None:
        """The pass launched or read a step; `decode_only`: it had no prefill chunk;
        `rows`, `decode_steps`: its rows and decode steps (a launched step's)."""
        self._is_decode = self._is_decode and decode_only
        self._rows = max(self._rows, rows)
        self._decode_steps = max(self._decode_steps, decode_steps)

    def end(self) -> None:
        """The pass is over: file it as a decode pass or another."""
        if self._is_decode:
            self.decode.append(self._current)
            self.rows.append(self._rows)
            self.decode_steps.append(self._decode_steps)
        else:
            self.other.append(self._current)

    def summary(self) -> dict[str, Any]:
        """Mean ms per pass of each phase, host ms (wall less the wait) mean and p50, for
        the decode passes and for the others."""
        return {"decode": _summary(self.decode, self.rows, self.decode_steps),
                "other": _summary(self.other, [], [])}


def _summary(passes: list[list[float]], rows: list[int], decode_steps: list[int]
             ) -> dict[str, Any]:
    if not passes:
        return {"passes": 0}
    a = 1000.0 * np.asarray(passes)
    wait = a[:, [_INDEX[p] for p in WAIT_PHASES]].sum(axis=1)
    host = a.sum(axis=1) - wait
    out: dict[str, Any] = {"passes": len(passes),
                           "phase_ms": {p: float(a[:, i].mean()) for i, p in enumerate(PHASES)},
                           "host_ms": float(host.mean()), "host_p50_ms": float(np.median(host)),
                           "wall_ms": float(a.sum(axis=1).mean())}
    if rows:
        out["rows_p50"] = float(np.median(rows))
    if decode_steps:  # host time per decode step: a pass that ran K in one dispatch / K
        per_step = host / np.asarray(decode_steps, np.float64)
        out["host_per_step_ms"] = float(per_step.mean())
        out["host_per_step_p50_ms"] = float(np.median(per_step))
        out["decode_steps_p50"] = float(np.median(decode_steps))
    return out


class NoPhases:
    """The timer off (`NO_PHASES`, EngineCore's while it holds no HostPhases): HostPhases'
    calls, each doing nothing, so the step path times itself without testing whether it
    is timed."""

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def timed(self, phase: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return fn(*args, **kwargs)

    def saw(self, decode_only: bool, rows: int = 0, decode_steps: int = 1) -> None:
        pass

    def end(self) -> None:
        pass


NO_PHASES = NoPhases()
