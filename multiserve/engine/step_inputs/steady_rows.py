"""The sampler's host inputs of a steady decode step, kept from the step before it.

In a plain decode step every logits row is a SEQUENCE row that samples one token (no
draft, no prompt-logprob row) and no row has a penalty (its output counts move), a
grammar (its mask moves) or banned ids (min_new_tokens still ahead). Such a row's
sampler fields depend only on its sample's params, seed and index (fixed for the Req's
life) and on its position, which moves every step. So while plain decode steps follow one
another with the same samples in the same rows and the same row bucket, the SamplingBatch
built for the first of them (engine/step_inputs/row_specs.py `step_rows`, then
`Runner.sampling_batch`) is reused by the next ones with only `position` rewritten, and
the step builds no RowSpec.

Owner: the StepInputs of one engine (device_step.py; only its thread calls in). What
invalidates the kept batch: a step that is not plain (it is dropped), other samples or
another order in the rows, another row bucket (rebuilt from the step's specs), and a kept row whose
min_new_tokens is not reached at this step (then it has bans: rebuilt; the rows with a
min_new_tokens are checked at every reuse). The [R, V]
zeros are not kept: they are the runner's at every step (`Runner.sampling_zeros`), so a
memory release that deletes them cannot leave a kept batch pointing at deleted buffers.

Bits: a reused batch holds, field for field, what `build_sampling_batch` builds for the
step again (tests/engine/test_host_path.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from multiserve.engine.sampling.sampler import SamplingBatch
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.request import Req
from multiserve.engine.step_inputs.sampling_batch import RowSpec

# (output counts, prompt mask, token mask) of a row bucket: the runner's device zeros
ZerosFor = Callable[[int], tuple[Any, Any, Any]]


def _plain(batch: ScheduledBatch) -> bool:
    """Every logits row of `batch` is its batch row's own one-token sampling row."""
    return (batch.num_tokens == len(batch.rows) == len(batch.plan)
            and all(row.samples for row in batch.rows))


class SteadyRows:
    """The kept SamplingBatch (small fields only) of the last plain decode step."""

    def __init__(self) -> None:
        self._reqs: tuple[Req, ...] = ()  # the kept batch's samples, by row
        self._num_rows = 0  # its logits row bucket
        self._small: SamplingBatch | None = None  # None: nothing kept
        self._wants_logprobs = False
        self._banned_before: tuple[Req, ...] = ()  # kept rows with a min_new_tokens
        self.reused = 0  # steps given a reused batch (a count for tests and probes)

    def reuse(self, batch: ScheduledBatch, num_rows: int,
              zeros_for: ZerosFor) -> tuple[SamplingBatch, bool] | None:
        """(the SamplingBatch of `batch` at row bucket `num_rows`, whether it wants
        logprobs) from the kept one, or None where it cannot be reused."""
        small = self._small
        if small is None or num_rows != self._num_rows or not _plain(batch):
            return None
        if tuple(row.req for row in batch.rows) != self._reqs:
            return None
        if any(r.num_generated < r.params.min_new_tokens for r in self._banned_before):
            return None
        position = np.zeros(small.position.shape[0], np.int32)
        position[:len(batch.rows)] = [row.end for row in batch.rows]
        counts, prompt_mask, token_mask = zeros_for(num_rows)
        self.reused += 1
        return (dataclasses.replace(small, position=position, output_counts=counts,
                                    prompt_mask=prompt_mask, token_mask=token_mask),
                self._wants_logprobs)

    def keep(self, batch: ScheduledBatch, num_rows: int, specs: Sequence[RowSpec | None],
             sb: SamplingBatch, wants_logprobs: bool) -> None:
        """Keep `sb`, built from `specs` for `batch`, if the step is plain; else drop
        what was kept."""
        self._small = None
        if not _plain(batch) or not all(
                s is not None and not s.ban_ids and s.token_mask is None
                and not s.params.sampler_fields.has_penalty for s in specs):
            return
        self._reqs = tuple(row.req for row in batch.rows)
        self._num_rows = num_rows
        self._small = dataclasses.replace(sb, output_counts=None, prompt_mask=None,
                                          token_mask=None)
        self._wants_logprobs = wants_logprobs
        self._banned_before = tuple(r for r in self._reqs if r.params.min_new_tokens > 0)
