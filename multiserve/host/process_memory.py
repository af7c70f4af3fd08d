"""This process's resident memory, as the kernel counts it (no jax; read by the HTTP side).

`process_memory()` -> {"rss_bytes", "peak_rss_bytes"}: VmRSS and VmHWM of
/proc/self/status (Linux); elsewhere the peak from `resource.getrusage` and no current
value (None). One process holds every engine of a fleet, its servers and the supervisor:
these are the whole fleet's numbers, not one engine's.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def _status_kib(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return None


def process_memory() -> dict[str, int | None]:
    try:
        text = STATUS.read_text()
    except OSError:
        text = ""
    rss, peak = _status_kib(text, "VmRSS"), _status_kib(text, "VmHWM")
    if peak is None:  # ru_maxrss: KiB on Linux, bytes on macOS
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"rss_bytes": None,
                "peak_rss_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024}
    return {"rss_bytes": None if rss is None else rss * 1024, "peak_rss_bytes": peak * 1024}
