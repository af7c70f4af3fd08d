"""The on-disk caches' one root and their one lock.

`cache_root()` is `$MULTISERVE_CACHE_DIR`, else `~/.cache/multiserve`; its users keep
their own subfolders (invariance plans, native kernels; converted models: see
model/loading/model_cache.py). `exclusive(path)` is a lock file held by one thread of one process
at a time: a cache filled by whoever comes first (a fleet's engines are threads, a test
run's workers are processes) is then filled once, the others wait and read it.

Invariant: a lock only saves duplicate work; every cache writes under a temporary name
and renames, so a cache stays correct where no lock exists (no fcntl: not POSIX).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("MULTISERVE_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "multiserve"


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Held by one holder at a time, between threads and processes (an flock on an open
    file description of its own); creates `path` and its folder."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, only duplicate work
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
