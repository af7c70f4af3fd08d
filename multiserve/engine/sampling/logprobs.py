"""StepLogprobs: one step's sampler logprob outputs, read to the host and unpacked per row.

Row b of a step is a logits row of its RowPlan (engine/sched/row_plan.py): a sequence's
sampled row, a prompt row that scores prompt token j, or a verify row. The arrays are
the sampler's: the sampled token's logprob [R], the top-k ids and logprobs [R, K] and the
logprobs of the requested token ids [R, S].

Invariant: read only; a record is built from row b's arrays alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multiserve.types import SamplingParams, TokenLogprob


class StepLogprobs:
    def __init__(self, sample: Any) -> None:
        """`sample`: the step's sampler output (device arrays: logprob, top_ids,
        top_logprobs, selected_logprobs); copied to the host once, here."""
        self.logprob = np.asarray(sample.logprob)
        self.top_ids = np.asarray(sample.top_ids)
        self.top_logprobs = np.asarray(sample.top_logprobs)
        self.selected = np.asarray(sample.selected_logprobs)

    def step(self, k: int) -> StepLogprobs:
        """Decode step k's logprobs of a dispatch that ran K decode steps (whose
        arrays have a leading step axis), already on the host: views, no copy."""
        return StepLogprobs(_DecodeStep(self, k))

    def _top(self, b: int, k: int) -> tuple[tuple[int, float], ...]:
        return tuple((int(self.top_ids[b, j]), float(self.top_logprobs[b, j]))
                     for j in range(k))

    def token(self, b: int, tok: int, params: SamplingParams) -> TokenLogprob:
        """The record of sampled token `tok` of row b: its logprob, the top
        `top_logprobs_num` and the logprobs of `token_ids_logprob`."""
        ids = params.token_ids_logprob or ()
        selected = tuple((int(t), float(self.selected[b, j])) for j, t in enumerate(ids))
        return TokenLogprob(tok, float(self.logprob[b]), self._top(b, params.top_logprobs_num),
                            selected)

    def prompt(self, b: int, token: int, params: SamplingParams) -> TokenLogprob:
        """The record of prompt token `token` scored by prompt row b (its one requested
        id: `step_inputs.row_specs.prompt_row_params`)."""
        return TokenLogprob(token, float(self.selected[b, 0]),
                            self._top(b, params.top_logprobs_num))


class _DecodeStep:
    """The sampler output fields of decode step k of a `StepLogprobs` of several."""

    def __init__(self, steps: StepLogprobs, k: int) -> None:
        self.logprob, self.top_ids = steps.logprob[k], steps.top_ids[k]
        self.top_logprobs, self.selected_logprobs = steps.top_logprobs[k], steps.selected[k]
