"""How dear this machine's kernel makes new memory: writes MB megabytes (default 540,
the default model's float32 weights) into memory got one way, in this new process, and
prints the wall and kernel seconds. Run each way from a new process after the machine
idled (e.g. `sleep 20; python scripts/first_touch_probe.py populate`): the cost moves with
what the machine did just before (docs/performance.md §36).

    python scripts/first_touch_probe.py {malloc|advise|populate|shared} [MB]
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys
import time

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux 5.14+


def main() -> int:
    how = sys.argv[1]
    n = (int(sys.argv[2]) if len(sys.argv) > 2 else 540) << 20
    t0, s0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
    if how in ("malloc", "advise"):
        buf = np.empty(n, np.uint8)
        if how == "advise":
            libc = ctypes.CDLL(None, use_errno=True)
            start = buf.ctypes.data & ~(mmap.PAGESIZE - 1)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(buf.ctypes.data + n - start),
                         MADV_POPULATE_WRITE)
    elif how == "populate":
        buf = np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                      | mmap.MAP_POPULATE), np.uint8)
    elif how == "shared":
        buf = np.frombuffer(mmap.mmap(-1, n), np.uint8)
    else:
        raise SystemExit(__doc__)
    buf[:] = 1
    wall = time.monotonic() - t0
    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0
    print(f"{how}: {n >> 20} MB written in {wall:.2f} s (kernel {kernel:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
