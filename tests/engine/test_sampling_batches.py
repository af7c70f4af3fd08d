"""SamplingBatches: the one owner of the sampler's cached device zeros (penalty arrays and
token mask) that penalty-free, mask-free steps reuse, and that memory release deletes."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.engine.step_inputs.sampling_batch import RowSpec, mask_words
from multiserve.engine.step_inputs.sampling_zeros import SamplingBatches, sampler_rows
from multiserve.types import SamplingParams

VOCAB = 96


def _batches() -> SamplingBatches:
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    return SamplingBatches(VOCAB, NamedSharding(mesh, P()))


def _row(**params: float) -> RowSpec:
    return RowSpec(params=SamplingParams(temperature=0.7, **params), seed=1, sample_index=0,
                   position=3, output_ids=(4, 4, 9), prompt_ids=(1, 2))


def test_penalty_free_steps_share_one_set_of_device_zeros_per_row_count() -> None:
    batches = _batches()
    first, again = batches.build([_row()], 3), batches.build([_row(), None], 4)
    rows = sampler_rows(4)
    for a, b in ((first.output_counts, again.output_counts),
                 (first.prompt_mask, again.prompt_mask), (first.token_mask, again.token_mask)):
        assert isinstance(a, jax.Array) and a is b and not np.asarray(a).any()
    assert first.output_counts.shape == (rows, VOCAB)
    assert first.token_mask.shape == (rows, mask_words(VOCAB))
    other = batches.build([_row()], rows + 1)  # the next row count: zeros of its own
    assert other.output_counts.shape[0] == sampler_rows(rows + 1) > rows
    # a penalised row fills its own host arrays; the cached zeros stay zeros
    penalised = batches.build([_row(frequency_penalty=0.5)], 3)
    assert penalised.output_counts is not first.output_counts
    assert np.asarray(penalised.output_counts)[0, 4] == 2
    assert not np.asarray(first.output_counts).any()


def test_drop_deletes_the_zeros_and_the_next_step_makes_them_again() -> None:
    batches = _batches()
    before = batches.build([_row()], 1)
    batches.drop()
    assert all(a.is_deleted() for a in (before.output_counts, before.prompt_mask,
                                         before.token_mask))
    after = batches.build([_row()], 1)
    assert after.output_counts is not before.output_counts
    assert not after.output_counts.is_deleted() and not np.asarray(after.output_counts).any()
