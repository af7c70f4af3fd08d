"""One compile per step program per process, whichever engine (device group) needs it.

A fleet runs one model with the same buckets on several device groups of one kind (4
engines on 4 chips or 4 virtual CPU devices; 2 TP engines of 2 devices each). Their step
programs lower to the same HLO text (shardings name mesh axes, never devices), but XLA
compiles an executable for a device assignment, and JAX's persistent compilation cache
keys CPU executables by it: each engine compiled every program again (a fleet's warm-up
grew with its engine count), and a restart found only its own devices' entries.

Two parts:
- **A device-free cache key** (`_install_device_free_key`): on CPU (and GPU, where JAX
  already does it) the persistent cache's key leaves out the device assignment, as JAX
  does for GPU; JAX then loads a cached executable onto the devices of the compile that
  asked for it (its own `deserialize_executable(bytes, devices, compile_options)` path).
  Checked on CPU: the loaded program runs on the asking devices and gives bitwise the
  compiling engine's results (1 and 2-device meshes; tests/engine/test_program_share.py
  checks the 1-device case).
- **Single flight** (`ProgramShare.compile`): while one engine compiles a program, the others
  that need the same program (same HLO text, platform, device kind and group size) wait
  for it, then compile it too, which is a cache hit (milliseconds). `first_alone` is the
  same wait for work that compiles through `jax.jit` on its first call (the weights'
  canonical layout rebuilt by every engine of a fleet updating its weights at once).

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

Guard: the device-free key patches a private JAX function, so it is installed only on the
JAX releases it was verified with (VERIFIED_JAX) and only where that function is present
with the expected signature (`hook_problem`). Otherwise sharing is off, with one warning:
a fleet still starts, each engine compiling its own programs (a JAX upgrade costs start-up
time, never a crash). get_internal_state's "program_sharing" and `multiserve doctor` say
which.

`MULTISERVE_SHARE_PROGRAMS=0` turns both parts off; `=force` installs the key on a JAX
outside VERIFIED_JAX (the presence and signature checks still hold).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# Platforms whose executables load onto other devices of the same kind (JAX strips the
# device assignment from GPU keys itself; CPU checked, see the module docstring). TPU: not
# assumed.
_DEVICE_FREE_PLATFORMS = ("cpu", "gpu")

# The JAX releases (major, minor; inclusive) with which the patched hook was verified by
# tests/engine/test_program_share.py (a cache hit on another device, bitwise the same
# outputs). Outside them the hook is left alone (unless MULTISERVE_SHARE_PROGRAMS=force):
# a private function of the same name could keep its signature yet change meaning, e.g.
# load a program without moving it onto the asking devices.
VERIFIED_JAX = ((0, 10), (0, 12))
_HOOK = "_hash_serialized_compile_options"  # in jax._src.cache_key, called by its get()

_install_lock = threading.Lock()
_install_problem: str | None = None  # why the hook could not be installed; "" once it is
_installed = False
unpatched_hook: Any = None  # JAX's own hook, once replaced


@dataclass(frozen=True)
class SharingStatus:
    """Whether this process shares step programs among its engines, and why (or why not).
    Reported by get_internal_state ("program_sharing") and `multiserve doctor`."""

    active: bool
    reason: str


def _jax_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _jax_cache_key() -> ModuleType | None:
    """JAX's private cache-key module, or None where this JAX has none."""
    try:
        from jax._src import cache_key
    except ImportError:
        return None
    return cache_key


def hook_problem() -> str | None:
    """Why the device-free cache key cannot be installed on this JAX, or None when it can.
    Reads only: the JAX version, and the presence and signature of the patched hook."""
    import jax

    forced = os.environ.get("MULTISERVE_SHARE_PROGRAMS") == "force"
    minor = _jax_minor(jax.__version__)
    (lo, hi) = VERIFIED_JAX
    if not forced and (minor is None or not lo <= minor <= hi):
        return (f"jax {jax.__version__} is outside the releases the cache-key hook was "
                f"verified with ({lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}); "
                "MULTISERVE_SHARE_PROGRAMS=force tries it anyway")
    cache_key = _jax_cache_key()
    if cache_key is None:
        return "jax has no jax._src.cache_key"
    hook = getattr(cache_key, _HOOK, None)
    if not callable(hook) or not callable(getattr(cache_key, "get", None)):
        return f"jax._src.cache_key has no {_HOOK} or get"
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError) as exc:
        return f"{_HOOK} has no readable signature ({exc})"
    if "strip_device_assignment" not in params:
        return f"{_HOOK} takes no strip_device_assignment"
    return None


def _install_device_free_key() -> bool:
    """Make JAX's persistent-cache key leave out the device assignment (idempotent).
    False, with one warning per process, when this JAX's hook is not the verified one
    (then each engine compiles its own programs: slower start-up, same programs)."""
    global _install_problem, _installed, unpatched_hook
    with _install_lock:
        if _install_problem is None:
            problem = hook_problem()
            cache_key = _jax_cache_key()
            if problem is None and cache_key is not None:
                hash_options = getattr(cache_key, _HOOK)

                def device_free(hash_obj: Any, compile_options: Any,
                                strip_device_assignment: bool = False) -> Any:
                    return hash_options(hash_obj, compile_options,
                                        strip_device_assignment=True)

                unpatched_hook = hash_options
                setattr(cache_key, _HOOK, device_free)
                _installed = True
            else:
                log.warning("program sharing off (each engine compiles its own programs): %s",
                            problem)
            _install_problem = problem or ""
        return _installed


def _cache_on() -> bool:
    import jax

    return bool(jax.config.jax_compilation_cache_dir) and bool(
        jax.config.jax_enable_compilation_cache)


def sharing_status(platform: str) -> SharingStatus:
    """Whether engines on `platform` share programs in this process (installs the hook
    where it applies, as the first compile would)."""
    if os.environ.get("MULTISERVE_SHARE_PROGRAMS", "1") == "0":
        return SharingStatus(False, "MULTISERVE_SHARE_PROGRAMS=0")
    if platform not in _DEVICE_FREE_PLATFORMS:
        return SharingStatus(False, f"{platform}: executables not known to load onto other "
                                    "devices")
    if not _cache_on():
        return SharingStatus(False, "the persistent compilation cache is off")
    if not _install_device_free_key():
        return SharingStatus(False, _install_problem or "")
    return SharingStatus(True, "device-free cache key, single-flight compiles")


class ProgramShare:
    """Single-flight compiles of identical programs (one instance per process: SHARE)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[Any, ...], threading.Event] = {}

    def compile(self, lowered: Any, devices: Sequence[Any],
                options: dict[str, bool | int]) -> Any:
        """The executable of `lowered` for `devices` (its mesh's devices, in order), compiled
        with XLA `options` (`xla_options.step_options`)."""
        d0 = devices[0]
        if not self._active(d0.platform):
            return lowered.compile(compiler_options=options)
        key = (d0.platform, d0.device_kind, len(devices), tuple(sorted(options.items())),
               hashlib.sha256(lowered.as_text().encode()).hexdigest())
        with self.first_alone(key, d0.platform):
            return lowered.compile(compiler_options=options)

    @contextmanager
    def first_alone(self, key: Hashable, platform: str) -> Iterator[None]:
        """Runs the body at once, unless another thread is inside the body of an equal `key`:
        then after it (the programs that one compiled are then cache hits here). `key` names
        the programs the body compiles (an unequal key only costs the compile, an equal one
        only the wait). Waits only where sharing is active."""
        if not self._active(platform):
            yield
            return
        with self._lock:
            running = self._in_flight.get(key)
            if running is None:
                mine = self._in_flight[key] = threading.Event()
        if running is not None:
            running.wait()
            yield
            return
        try:
            yield
        finally:  # compiled and cached, or failed: either way the waiters go on now
            with self._lock:
                del self._in_flight[key]
            mine.set()

    @staticmethod
    def _active(platform: str) -> bool:
        return sharing_status(platform).active


SHARE = ProgramShare()
