"""Host arrays whose pages are faulted in by the kernel at once, for buffers that are
written whole right after they are made (a model's stacked weights).

`populated_empty(shape, dtype)` is `np.empty` whose memory comes from one
mmap(MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE) call where the buffer is large (at least
`MIN_BYTES`) and the platform has the flag; else `np.empty` itself. Placement only: the
array's values are unset as np.empty's, and its memory is freed with it (the array holds
the mapping). Page-aligned, such a buffer is one jax's CPU `device_put` places without a
copy: the placed array then holds it (the loader's weights are never donated; only the
K/V pool is).
Why: writing a new buffer faults its pages in one at a time, and in a VM whose free memory
goes back to its host (Firecracker with free page reporting) each of those faults is dear:
540 MB written into new memory after a 20 s idle took 7.0 s there, the same bytes
populated by the mmap call 0.4-0.7 s (docs/performance.md §36).
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

MIN_BYTES = 2 << 20  # smaller buffers: np.empty (malloc's own pools)
_POPULATE = getattr(mmap, "MAP_POPULATE", None)


def populated_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-ordered array of `shape` and `dtype` (module docstring)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dt.itemsize
    if _POPULATE is None or nbytes < MIN_BYTES:
        return np.empty(shape, dt)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except OSError:
        return np.empty(shape, dt)
    return np.frombuffer(buf, dt, count).reshape(shape)
