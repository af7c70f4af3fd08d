"""Device: the facade the engine's step loop runs a step through.

`Device.run(DeviceStep) -> InFlight`: the step's inputs (engine/step_inputs/device_step.py)
go to the runner (runner.py), which picks the step's programs (step_programs.py) and
launches them without waiting; what comes back is the step in flight, a value the loop
holds until it reads the step's results. The runner and the programs keep their own
rooms behind this one; what else the engine asks of its device (LoRA writes, weights,
memory release, compiled sizes) it asks the runner.

Invariant: an InFlight is never written after `run` returns; its batch is the
ScheduledBatch as scheduled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from multiserve.engine.device.runner import Runner, StepOutput
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.step_inputs.device_step import DeviceStep


@dataclass(frozen=True)
class InFlight:
    """A launched step whose results are not read yet."""
    batch: ScheduledBatch
    out: StepOutput  # the runner's (device) results
    padded_tokens: int  # the token bucket it ran in
    launched_at: float  # perf_counter at its launch
    out_slots: np.ndarray | None = None  # routing replay: its token rows' KV slots [T]


class Device:
    """Runs one engine's steps on its runner (module doc)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def run(self, step: DeviceStep) -> InFlight:
        """Launch `step` (never waits for the device): the step in flight."""
        launched_at = time.perf_counter()
        out = self.runner.run(step.arrays, step.sampling, step.wants_logprobs, step.num_rows,
                              step.decode_steps)
        return InFlight(step.batch, out, step.num_tokens, launched_at,
                        step.arrays.out_slots if out.routed_experts is not None else None)
