"""The weight-update session of one engine: tpu-inference's `start_weight_update
(free_kv_cache)` ... `finish_weight_update`, vLLM's /start_weight_update, /update_weights,
/finish_weight_update, on the staged, versioned update of rl/weights.py.

Owns `WeightSession` (one per engine, engine thread only): whether a session is open, its
staging token, whether it freed the KV pool, and whether a checkpoint was staged in it.
  start(free_kv_cache, abort_running): WeightManager.begin (the engine is held,
      "weights_staged"; refused while requests run unpaused, unless abort_running); with
      free_kv_cache, the KV pool is released too (MemoryManager, mode retract: requests
      holding K/V keep their output and re-prefill with the new weights after)
  token(): the open session's staging token, for staging one checkpoint into it (off the
      engine thread: ControlRunner); a second checkpoint is refused, as vLLM's disk
      backend refuses one
  finish(weight_version): publish what was staged under `weight_version` (the staged
      version if None), then bring the KV pool back if the session freed it, and close
  abort(): discard what was staged, bring the KV pool back, close (a failed staging, or
      the caller's abort_weight_update)
Every answer is a ControlResult naming the session's outcome; finish names the version.

Invariants: at most one session per engine; while it is open the engine is held (no step
runs); a session ends only by finish or abort, and either one restores what start freed.
The engine is touched only through the managers (and they through RLInterface).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from multiserve.engine.rl.memory import MemoryManager
from multiserve.engine.rl.weights import WeightManager
from multiserve.types import ControlResult


@dataclass(frozen=True)
class _Open:
    token: str
    kv_freed: bool
    staged: bool = False


def _refused(message: str, refused: str) -> ControlResult:
    return ControlResult(False, message, {"refused": refused})


class WeightSession:
    def __init__(self, weights: WeightManager, memory: MemoryManager) -> None:
        self.weights = weights
        self.memory = memory
        self._open: _Open | None = None

    @property
    def active(self) -> bool:
        return self._open is not None

    def start(self, free_kv_cache: bool, abort_running: bool) -> ControlResult:
        if self._open is not None:
            return _refused("a weight update session is open already: finish or abort it "
                            "first", "session_open")
        begun = self.weights.begin(abort_running)
        if not begun.ok:
            return begun
        token = begun.details["token"]
        freed: dict = {}
        if free_kv_cache:
            released = self.memory.release(("kv_cache",), "retract", False)
            if not released.ok:
                self.weights.discard(token)
                return released
            freed = released.details
        self._open = _Open(token, kv_freed=free_kv_cache)
        return ControlResult(True, "weight update session started"
                             + (" (KV cache freed)" if free_kv_cache else ""),
                             {"free_kv_cache": free_kv_cache,
                              "aborted": begun.details.get("aborted", 0), **freed})

    def token(self) -> ControlResult:
        """The open session's token for one staging (details["token"]), or a refusal."""
        if self._open is None:
            return _refused("no weight update session: start_weight_update first",
                            "no_session")
        if self._open.staged:
            return _refused("this session has a checkpoint staged already (one per "
                            "session): finish_weight_update, or abort", "staged")
        self._open = replace(self._open, staged=True)
        return ControlResult(True, "stage into the session", {"token": self._open.token})

    def finish(self, weight_version: str | None) -> ControlResult:
        session = self._open
        if session is None:
            return _refused("no weight update session: start_weight_update first",
                            "no_session")
        if not session.staged or not self.weights.has_staged(session.token):
            aborted = self.abort()
            return ControlResult(False, "no checkpoint was staged in this session: it is "
                                 "aborted, the weights are unchanged",
                                 {"refused": "nothing_staged", **aborted.details})
        published = self.weights.publish(session.token, abort_running=False,
                                         weight_version=weight_version)
        if not published.ok:
            return published  # the session stays open: finish again or abort
        self._open = None
        details = dict(published.details)
        if session.kv_freed:
            details["kv_cache_resumed"] = self.memory.resume(("kv_cache",)).ok
        return ControlResult(True, published.message, details)

    def abort(self) -> ControlResult:
        session, self._open = self._open, None
        if session is None:
            return ControlResult(True, "no weight update session (no-op)", {"aborted": False})
        discarded = self.weights.discard(session.token)
        details = {"aborted": True, "discarded": discarded.details.get("discarded", False)}
        if session.kv_freed:
            details["kv_cache_resumed"] = self.memory.resume(("kv_cache",)).ok
        return ControlResult(True, "weight update session aborted (weights unchanged)",
                             details)
