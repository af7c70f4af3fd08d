"""Routing replay on the host: the expert ids of every KV slot's token, and the
`RoutedExperts` record of a finished sample.

Owns `RoutedExpertsTable`, made only by an engine started with
`enable_return_routed_experts` on a MoE model: a host array [KV slots, MoE layers, k]
int32. After a step's outputs are read back, `record` writes its ids at the step's
`out_slots` (the slots its tokens' K/V went to; padding rows write the garbage page,
which no sequence reads). A sample's row for position p is therefore at the slot of its
page table's position p, wherever that K/V came from: its own prefill, a decode, a verify
row, a sibling's or an earlier request's prefix-cache page, a recompute after a
retraction.

Invariants: a slot's ids are those of the token whose K/V it holds: both are written by
the same step, and steps are read back in launch order, so a later step (a recompute, a
corrected draft position) overwrites an earlier one. A position p < P + O - 1 of a sample
(P prompt, O output tokens read back) was computed by a step already read back: the
token at p + 1 came from it. The last token has no row (no forward ran on it yet).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from multiserve.config import ModelConfig
from multiserve.types import RoutedExperts

UNROUTED = -1  # the id in a dense layer's slots (as sglang-jax)


class RoutedExpertsTable:
    """The expert ids of every KV slot (module docstring)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, page_size: int) -> None:
        assert cfg.moe_layers, "routing replay needs a mixture-of-experts model"
        self.page_size = page_size
        self.num_layers = cfg.num_layers
        self.moe_layers = tuple(cfg.moe_layers)
        self.top_k = cfg.num_experts_per_tok
        self._ids = np.full((num_slots, len(self.moe_layers), self.top_k), UNROUTED, np.int32)

    @property
    def nbytes(self) -> int:
        return int(self._ids.nbytes)

    def record(self, out_slots: np.ndarray, ids: np.ndarray) -> None:
        """A read-back step's ids [T, MoE layers, k] at its token rows' slots [T]."""
        self._ids[np.asarray(out_slots)] = np.asarray(ids)

    def rows(self, pages: Sequence[int], end: int) -> np.ndarray:
        """The ids of positions [0, end) of a sequence whose page table is `pages`
        (a copy: [end, MoE layers, k])."""
        pos = np.arange(end)
        slots = np.asarray(pages, np.int64)[pos // self.page_size] * self.page_size \
            + pos % self.page_size
        return self._ids[slots]

    def encode(self, rows: np.ndarray, start: int) -> RoutedExperts:
        """`RoutedExperts` of rows [start, len(rows)) of a sample's MoE-layer ids, over
        every layer: a dense layer's slots hold UNROUTED."""
        part = rows[start:]
        full = np.full((part.shape[0], self.num_layers, self.top_k), UNROUTED, "<i4")
        full[:, list(self.moe_layers)] = part
        return RoutedExperts(start=start, num_layers=self.num_layers, top_k=self.top_k,
                             data=full.tobytes())
