"""Bucket sizes: the smallest size of a set that holds a count (`smallest_fit`), how a
step picks its programs' sizes (engine/device/runner.py `bucket_for`) and how the
scheduler tells whether a decode step has a program of K decode steps
(engine/sched/compiled_sizes.py `CompiledSizes`)."""

from __future__ import annotations

from collections.abc import Iterable


def smallest_fit(ready: Iterable[int], n: int) -> int | None:
    """The smallest size in `ready` that holds n (None: none does)."""
    fits = [s for s in ready if s >= n]
    return min(fits) if fits else None
