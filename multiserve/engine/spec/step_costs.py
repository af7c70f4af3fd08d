"""StepCosts: the measured wall time of a step by its padded token count (its T bucket),
and the choice of how many draft tokens a step should carry.

A step's cost is flat while it is memory-bound (every weight is streamed once whatever the
row count) and grows once it is compute-bound, so a draft token is worth verifying only
where the tokens it is expected to add outweigh what its bucket costs more. The engine
thread records every step it reads (`observe`: launch to results read, the host's work
included); buckets not measured yet are estimated from the nearest measured ones (an
optimistic guess, so an unseen bucket gets tried once and measured). Plain Python.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

EWMA = 0.2  # weight of a new observation
MARGIN = 1.1  # drafts only where they are expected to add at least 10% tokens/s
UNSEEN_GROWTH = 0.05  # assumed cost growth per doubling of tokens past the measured


class StepCosts:
    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._seconds: dict[int, float] = {}
        # the host's work between reading a step and launching the next when nothing is
        # in flight (a moving average); a step with drafts pays it where overlap scheduling
        # would otherwise hide it (`overlap`, set by the engine)
        self.host_seconds = 0.0
        self.overlap = True

    def observe_host(self, seconds: float) -> None:
        self.host_seconds = (seconds if self.host_seconds == 0.0
                             else (1 - EWMA) * self.host_seconds + EWMA * seconds)

    def bucket(self, tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def observe(self, bucket: int, seconds: float) -> None:
        old = self._seconds.get(bucket)
        self._seconds[bucket] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds

    def measured(self) -> dict[int, float]:
        return dict(self._seconds)

    def cost(self, bucket: int) -> float | None:
        """Seconds of a step of this bucket: measured, else from the nearest measured
        buckets (linear between two; above the largest, nearly flat: UNSEEN_GROWTH per
        doubling, so an unseen bucket is tried and measured); None when nothing at or
        below it is measured."""
        if bucket in self._seconds:
            return self._seconds[bucket]
        below = [b for b in self._seconds if b < bucket]
        above = [b for b in self._seconds if b > bucket]
        if not below:
            return None
        lo = max(below)
        if above:
            hi = min(above)
            w = (bucket - lo) / (hi - lo)
            return (1 - w) * self._seconds[lo] + w * self._seconds[hi]
        return self._seconds[lo] * (1.0 + UNSEEN_GROWTH * math.log2(bucket / lo))

    def best_draft_count(self, base_tokens: int, base_rows: int,
                         gains: Sequence[float]) -> int:
        """How many of the draft tokens to verify: `gains[i]` is the expected tokens the
        i-th most promising draft token adds (descending); a step of `base_tokens`
        tokens emits `base_rows` tokens without drafts. Maximises expected tokens per
        second over the buckets (a step with drafts also pays the host time that overlap
        would have hidden); 0 where the base step's bucket is not measured yet."""
        b0 = self.bucket(base_tokens)
        c0 = self.cost(b0) if b0 is not None else None
        if c0 is None:
            return 0
        best_value, best_n = base_rows / c0, 0
        expected = float(base_rows)
        for i, g in enumerate(gains):
            b = self.bucket(base_tokens + i + 1)
            if b is None:
                break
            c = self.cost(b)
            if c is None:
                break
            c += self.host_seconds if self.overlap else 0.0  # the drafts end the overlap
            expected += g
            if expected / c > best_value:
                best_value, best_n = expected / c, i + 1
        # the estimate must beat the plain step by a margin: costs are noisy moving
        # averages and the acceptance a guess, and a wrong "yes" is paid every step
        return best_n if best_value >= MARGIN * base_rows / c0 else 0
