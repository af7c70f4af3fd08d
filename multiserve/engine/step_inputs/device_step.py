"""DeviceStep: everything the device needs to run one step, built from its ScheduledBatch.

The room's one entry: `StepInputs.build(batch) -> DeviceStep`. It picks the step's
compiled buckets (the device says which: `StepShapes`), pads the batch into its token
arrays and page table (token_arrays.py), and gives every logits row its sampler row
(row_specs.py) as a padded SamplingBatch (sampling_batch.py, with the device's cached
zeros: sampling_zeros.py), or reuses the one kept from the plain decode step before
(steady_rows.py). The device facade (engine/device/device.py) runs the value it returns.

Owner: the EngineCore (one StepInputs per engine; only its thread calls in: the kept
SteadyRows are this engine's).

Invariant: a DeviceStep is never written after `build` returns; `batch` is the
ScheduledBatch it was built from (also never written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from multiserve.engine.sampling.sampler import SamplingBatch
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.step_inputs.row_specs import step_rows
from multiserve.engine.step_inputs.sampling_batch import RowSpec, mask_words
from multiserve.engine.step_inputs.steady_rows import SteadyRows
from multiserve.engine.step_inputs.token_arrays import StepArrays, build_step_arrays


@dataclass(frozen=True)
class DeviceStep:
    """One step's device inputs, padded to its buckets."""

    batch: ScheduledBatch  # what the step computes (the scheduler's, never written)
    arrays: StepArrays  # the token arrays and page table, padded to the token bucket
    sampling: SamplingBatch  # the sampler rows, padded to the row bucket's sampler rows
    wants_logprobs: bool  # some row wants logprobs: the step returns them
    num_rows: int  # the logits row bucket R

    @property
    def num_tokens(self) -> int:
        """The token bucket T the step runs in."""
        return int(self.arrays.input_ids.shape[0])

    @property
    def decode_steps(self) -> int:
        """Decode steps the one dispatch runs (ScheduledBatch.decode_steps)."""
        return self.batch.decode_steps


class StepShapes(Protocol):
    """What the device tells the inputs room (the Runner is one): its compiled buckets,
    its row buffer, whether its steps take LoRA slots, and its sampler zeros."""

    @property
    def max_rows(self) -> int: ...

    @property
    def lora_enabled(self) -> bool: ...

    def bucket_for(self, num_tokens: int, num_rows: int) -> tuple[int, int]: ...

    def page_table_rows(self, num_tokens: int) -> int: ...

    def sampling_batch(self, rows: Sequence[RowSpec | None],
                       num_rows: int) -> SamplingBatch: ...

    def sampling_zeros(self, num_rows: int) -> tuple[Any, Any, Any]: ...


class StepInputs:
    """Builds each step's DeviceStep (module doc); keeps the steady rows between steps."""

    def __init__(self, shapes: StepShapes, rules: StopRules, vocab_size: int, max_pages: int,
                 page_size: int) -> None:
        self.shapes = shapes
        self.rules = rules
        self.mask_words = mask_words(vocab_size)
        self.max_pages = max_pages
        self.page_size = page_size
        # a plain decode step's sampler inputs, reused by the next plain steps of the
        # same samples (steady_rows.py)
        self.steady_rows = SteadyRows()

    def build(self, batch: ScheduledBatch) -> DeviceStep:
        """The DeviceStep of `batch`: its buckets, token arrays and sampler rows."""
        shapes = self.shapes
        t_pad, r_pad = shapes.bucket_for(batch.num_tokens, batch.num_logit_rows)
        arrays = build_step_arrays(batch, t_pad, shapes.page_table_rows(t_pad),
                                   shapes.max_rows, self.max_pages, self.page_size,
                                   shapes.lora_enabled)
        kept = self.steady_rows.reuse(batch, r_pad, shapes.sampling_zeros)
        if kept is not None:
            sampling, wants_lp = kept
        else:
            specs, wants_lp = step_rows(batch, self.rules, self.mask_words)
            sampling = shapes.sampling_batch(specs, r_pad)
            self.steady_rows.keep(batch, r_pad, specs, sampling, wants_lp)
        return DeviceStep(batch, arrays, sampling, wants_lp, r_pad)
