"""The engine's large host buffers on 2 MiB transparent huge pages (Linux, CPU devices).

Every step streams the weights (and a decode step its sequences' K/V rows) from memory: on
the CPU that read rate bounds the single stream and a good part of a batched step. On 4 KiB pages
a stream crosses a page every 4 KiB: a TLB miss each, and the hardware prefetchers stop at
every boundary. Backed by 2 MiB pages the same read runs ~1.27x faster on the Zen 4 EPYC
(docs/performance.md §15). XLA:CPU allocates with malloc, and glibc's default leaves
THP to a system whose setting is usually "madvise", so nothing is huge unless asked.

`back_with_huge_pages(tree)` asks for the 2 MiB-aligned interior of every CPU buffer of at
least 2 MiB in `tree`: MADV_HUGEPAGE (new faults and khugepaged use huge pages), then
MADV_COLLAPSE (Linux 6.1+: the pages already there are collapsed now; elsewhere the first
advice alone). Placement only: no value, no layout, no bit changes; the kernel swaps the
pages under a live mapping, so steps may run meanwhile, and a buffer freed meanwhile only
makes the call fail (ENOMEM) or advise whatever memory is there now.
`in_background(tree, done)` runs it on a daemon thread: collapsing copies the pages, ~1.2 s
per GB here, which neither an engine's start nor a weight update waits for. The engine asks
it for the weights' compute tree (load, updates, resume), not for the KV pool: a decode
step reads a fraction of the pool, whose collapse took 3.5 s for 0.3 ms of a 65 ms step.
MULTISERVE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

log = logging.getLogger("multiserve.huge_pages")

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 (4 KiB base) transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV = "MULTISERVE_HUGE_PAGES"


@dataclass(frozen=True)
class HugePageAdvice:
    """What one call asked for: bytes advised, bytes collapsed now, why none (or None)."""

    advised_bytes: int
    collapsed_bytes: int
    skipped: str | None = None


def unavailable_reason() -> str | None:
    """Why huge pages are not asked for here (None: they are)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        with open(THP_SETTING) as f:
            if "[never]" in f.read():
                return "transparent huge pages are off on this system ([never])"
    except OSError:
        return "no transparent huge pages on this kernel"
    return None


def _cpu_buffers(tree: Any) -> dict[int, int]:
    """{pointer: bytes} of the distinct single-device CPU arrays of at least one huge page in
    `tree`. An array over several devices (a tensor-parallel group of virtual CPU devices)
    is left alone: its shards are reached only through per-shard arrays that the parent
    keeps alive, which would outlive a weight update."""
    found: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted() or leaf.nbytes < HUGE_PAGE:
            continue
        devices = leaf.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            continue
        found[leaf.unsafe_buffer_pointer()] = leaf.nbytes
    return found


def back_with_huge_pages(tree: Any) -> HugePageAdvice:
    """Ask for huge pages under the CPU buffers of `tree` (see the module's text)."""
    return _advise(_cpu_buffers(tree))


def in_background(tree: Any, done: Callable[[HugePageAdvice], None]) -> threading.Thread:
    """`back_with_huge_pages(tree)` on a daemon thread, `done(advice)` with its result. The
    thread holds the buffers' addresses, never the arrays: a tree replaced meanwhile is
    freed as usual."""
    buffers = _cpu_buffers(tree)
    thread = threading.Thread(target=lambda: done(_advise(buffers)), name="huge-pages",
                              daemon=True)
    thread.start()
    return thread


def _advise(buffers: dict[int, int]) -> HugePageAdvice:
    reason = unavailable_reason()
    if reason is not None:
        return HugePageAdvice(0, 0, reason)
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advised = collapsed = 0
    for pointer, nbytes in buffers.items():
        start = -(-pointer // HUGE_PAGE) * HUGE_PAGE
        length = (pointer + nbytes) // HUGE_PAGE * HUGE_PAGE - start
        if length <= 0:
            continue
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            err = ctypes.get_errno()
            log.info("huge pages refused (madvise: %s)", os.strerror(err))
            return HugePageAdvice(advised, collapsed, f"madvise: {os.strerror(err)}")
        advised += length
        if madvise(start, length, MADV_COLLAPSE) == 0:
            collapsed += length
    return HugePageAdvice(advised, collapsed)
