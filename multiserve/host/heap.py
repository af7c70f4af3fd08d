"""Returning freed host heap to the OS (no jax; used by the engine and the launcher)."""

from __future__ import annotations


def release_free_heap() -> bool:
    """Ask the C allocator to return freed heap pages to the OS (glibc's malloc_trim).
    Compiles leave GBs of freed compiler scratch in the heap, which glibc keeps: without
    this a 4-engine CPU fleet sits at its warm-up peak. True if it ran; a no-op (False)
    without glibc. Host memory only: says nothing about device memory."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
