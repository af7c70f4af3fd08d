"""One compile per step program per process, whichever engine (device group) needs it.

A fleet runs one model with the same buckets on several device groups of one kind (4
engines on 4 chips or 4 virtual CPU devices; 2 TP engines of 2 devices each). Their step
programs lower to the same HLO text (shardings name mesh axes, never devices), but XLA
compiles an executable for a device assignment, and JAX's persistent compilation cache
keys CPU executables by it: each engine compiled every program again, 4x the warm-up of
one engine, and a restart found only its own devices' entries.

Two parts:
- **A device-free cache key** (`_install_device_free_key`): on CPU (and GPU, where JAX
  already does it) the persistent cache's key leaves out the device assignment, as JAX
  does for GPU; JAX then loads a cached executable onto the devices of the compile that
  asked for it (its own `deserialize_executable(bytes, devices, compile_options)` path).
  Measured on CPU: the loaded program runs on the asking devices and gives bitwise the
  compiling engine's results (1 and 2-device meshes).
- **Single flight** (`ProgramShare.compile`): while one engine compiles a program, the others
  that need the same program (same HLO text, platform, device kind and group size) wait
  for it, then compile it too, which is a cache hit (milliseconds).

Invariants:
- Only used where both hold: the persistent cache is on and the key is device-free;
  otherwise every engine simply compiles its own program (what JAX does by default).
- The waiters hold their compile slots while they wait; the compile in progress already
  holds its own, so it never needs another: no deadlock.
- Sharing only ever saves time, never changes a program: whatever is loaded is the
  compiling engine's machine code, and a failed compile is not waited on again.

Why not serialize programs ourselves: XLA:CPU executables that JAX loaded from the
persistent cache do not survive a second serialize/load ("Function wrapped_iota not
found" when run); JAX's own cache path always loads the bytes of a fresh compile.

`MULTISERVE_SHARE_PROGRAMS=0` turns both parts off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

# Platforms whose executables load onto other devices of the same kind (JAX strips the
# device assignment from GPU keys itself; CPU measured here). TPU: not assumed.
_DEVICE_FREE_PLATFORMS = ("cpu", "gpu")

_install_lock = threading.Lock()
_installed: bool | None = None  # None: not tried; False: could not


def _install_device_free_key() -> bool:
    """Make JAX's persistent-cache key leave out the device assignment (idempotent).
    False when this JAX has no such hook (then engines compile their own programs)."""
    global _installed
    with _install_lock:
        if _installed is None:
            try:
                from jax._src import cache_key

                hash_options = cache_key._hash_serialized_compile_options  # noqa: SLF001

                def device_free(hash_obj: Any, compile_options: Any,
                                strip_device_assignment: bool = False) -> Any:
                    return hash_options(hash_obj, compile_options,
                                        strip_device_assignment=True)

                cache_key._hash_serialized_compile_options = device_free  # noqa: SLF001
                _installed = True
            except (ImportError, AttributeError) as exc:
                log.warning("program sharing off: this JAX has no cache-key hook (%r)", exc)
                _installed = False
        return _installed


def _cache_on() -> bool:
    import jax

    return bool(jax.config.jax_compilation_cache_dir) and bool(
        jax.config.jax_enable_compilation_cache)


class ProgramShare:
    """Single-flight compiles of identical programs (one instance per process: SHARE)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[Any, ...], threading.Event] = {}

    def compile(self, lowered: Any, devices: Sequence[Any]) -> Any:
        """The executable of `lowered` for `devices` (its mesh's devices, in order)."""
        if not self._active(devices[0].platform):
            return lowered.compile()
        d0 = devices[0]
        key = (d0.platform, d0.device_kind, len(devices),
               hashlib.sha256(lowered.as_text().encode()).hexdigest())
        with self._lock:
            running = self._in_flight.get(key)
            if running is None:
                mine = self._in_flight[key] = threading.Event()
        if running is not None:
            running.wait()  # another engine compiles it: ours is then a cache hit
            return lowered.compile()
        try:
            return lowered.compile()
        finally:  # kept in the cache, or failed: either way the waiters compile now
            with self._lock:
                del self._in_flight[key]
            mine.set()

    @staticmethod
    def _active(platform: str) -> bool:
        if os.environ.get("MULTISERVE_SHARE_PROGRAMS", "1") == "0":
            return False
        if platform not in _DEVICE_FREE_PLATFORMS or not _cache_on():
            return False
        return _install_device_free_key()


SHARE = ProgramShare()
