"""Python's cyclic garbage collector in a process multiserve owns (no jax).

A serving process holds millions of long-lived, GC-tracked objects: jax, the tokenizer, each
engine's traced programs (a default-model engine's jaxprs alone are ~370k objects). Python's
default first-generation threshold (700 net allocations) makes a full collection, a scan of
every one of them, frequent: 9 of them (1.2 CPU-s) in one `multiserve validate` start-up,
none at `GC_THRESHOLDS` (docs/performance.md §29). Young garbage is still collected every
`GC_THRESHOLDS[0]` allocations; only how often the old objects are rescanned changes.

`tune_collector()` is for processes multiserve owns (its command line, the test suite's
processes); a library import never changes the interpreter's collector.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (10_000, 10, 10)  # gc.set_threshold's three generations


def tune_collector() -> None:
    """Set this process's collector thresholds to `GC_THRESHOLDS`."""
    gc.set_threshold(*GC_THRESHOLDS)
