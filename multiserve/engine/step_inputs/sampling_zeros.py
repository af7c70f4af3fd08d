"""The host sampling inputs of one engine's steps, and the device zeros they reuse.

A step's SamplingBatch (sampling_batch.py) carries three [R, V]-sized arrays (the two
penalty arrays and the [R, V/32] token mask) that are all zeros unless some row has a
penalty or a grammar. `SamplingBatches` is their one owner: it keeps, per sampler row
count, those zeros on the engine's devices (made on first use), and hands them to every
penalty-free / mask-free step, so such a step moves and allocates no [R, V] data.

Invariants:
- The cached zeros are per engine (per `SamplingBatches`), never module-level; they are
  only ever read by a step, never written (the programs do not donate them).
- `drop()` deletes them (memory release); the next step makes them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.step_inputs import sampling_batch as sampling_host


def sampler_rows(num_rows: int) -> int:
    """Rows the sampler runs for `num_rows` logits rows: a multiple of its chunk."""
    return -(-num_rows // sampling.ROW_CHUNK) * sampling.ROW_CHUNK


class SamplingBatches:
    """Builds the host SamplingBatch of a step, with this engine's cached device zeros."""

    def __init__(self, vocab_size: int, sharding: NamedSharding) -> None:
        self.vocab_size = vocab_size
        self.sharding = sharding  # where the zeros live: where the programs read them
        self._penalty_zeros: dict[int, sampling_host.PenaltyZeros] = {}
        self._mask_zeros: dict[int, jax.Array] = {}

    def build(self, rows: Sequence[sampling_host.RowSpec | None],
              num_rows: int) -> sampling.SamplingBatch:
        """Host sampling inputs for one step of `num_rows` logits rows (padded to
        `sampler_rows`); penalty-free steps reuse the device-resident zero [rows, V]
        arrays of that row count."""
        rows_padded = sampler_rows(num_rows)
        penalties, masks = self.zeros(num_rows)
        return sampling_host.build_sampling_batch(rows, rows_padded, self.vocab_size,
                                                  zeros=penalties, no_masks=masks)

    def zeros(self, num_rows: int) -> tuple[sampling_host.PenaltyZeros, jax.Array]:
        """The device-resident zeros of a step of `num_rows` logits rows (its penalty
        arrays and its token mask, at `sampler_rows`), made on first use."""
        rows_padded = sampler_rows(num_rows)
        if rows_padded not in self._penalty_zeros:
            zeros = sampling_host.penalty_zeros(rows_padded, self.vocab_size)
            self._penalty_zeros[rows_padded] = sampling_host.PenaltyZeros(
                *jax.device_put(tuple(zeros), self.sharding))
            self._mask_zeros[rows_padded] = jax.device_put(
                sampling_host.mask_zeros(rows_padded, self.vocab_size), self.sharding)
        return self._penalty_zeros[rows_padded], self._mask_zeros[rows_padded]

    def drop(self) -> None:
        """Delete the cached device zeros (memory release); `build` makes them again."""
        buffers = [*(a for z in self._penalty_zeros.values() for a in z),
                   *self._mask_zeros.values()]
        self._penalty_zeros.clear()
        self._mask_zeros.clear()
        for a in buffers:
            if isinstance(a, jax.Array) and not a.is_deleted():
                a.delete()
