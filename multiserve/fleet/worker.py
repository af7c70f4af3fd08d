"""EngineWorker: one engine slot of the fleet (one device group), as an EngineClient.

Owns: the slot's identity (index, device_indexes, port), its lifecycle state
(starting -> ready -> [restarting -> ready | failed] -> stopped), the `Engine` currently
in the slot, and the count of streams in flight through it (for a draining shutdown).

Invariants (docs/architecture.md §3):
- The `Engine` is itself thread-confined (one thread, one command queue); the worker
  only delegates to its thread-safe public methods and never touches engine state.
- A slot never serves from two engines at once: `restart()` shuts the old engine down
  (its live requests end with an error) before it builds the new one on the same
  devices. Whoever holds the worker (the HTTP app, the supervisor) sees the new engine
  without being rebuilt.
- Every device array belongs to exactly one Engine (its runner's params, KV pool and
  buffers are per instance), so two workers never share a device array.
- `health()` is (False, reason) whenever the slot cannot take work: starting,
  restarting, failed, draining, stopped, or the engine's own step failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from multiserve.config import EngineConfig
from multiserve.types import ControlResult, EngineUnavailable, GenerateRequest

EngineFactory = Callable[[EngineConfig], Any]


def _default_factory(cfg: EngineConfig) -> Any:
    from multiserve.engine.engine import Engine

    return Engine(cfg)


class EngineWorker:
    """The fleet's handle on engine `index` (implements `multiserve.types.EngineClient`)."""

    def __init__(self, index: int, engine_config: EngineConfig, *, port: int | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.index = index
        self.config = engine_config
        self.port = port
        self._factory = engine_factory or _default_factory
        self._engine: Any = None
        self._state = "starting"
        self._reason = "starting: the engine is being built and warmed up"
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active_streams = 0
        self._draining = False
        self._model_name = engine_config.served_model_name or "unknown"
        self._context_len = engine_config.max_context_len or 0
        self._tokenizer: Any = None  # set once, from the first engine built
        self.tokenizer_dir: Any = None
        self.model_path: Any = None
        self.build_seconds: float | None = None
        self.restart_count = 0

    # ---- identity --------------------------------------------------------------------
    @property
    def device_indexes(self) -> tuple[int, ...]:
        return self.config.device_indexes

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def context_len(self) -> int:
        return self._context_len

    @property
    def state(self) -> str:
        return self._state

    @property
    def tokenizer(self) -> Any:
        """The first engine's tokenizer instance: the HTTP side shares it (one tokenizer
        per engine; a restarted engine loads the same files again)."""
        return self._tokenizer

    @property
    def engine(self) -> Any:
        """The Engine in the slot now (None while starting or after a failed build)."""
        return self._engine

    def identity(self) -> dict[str, Any]:
        eng = self._engine
        return {"engine_index": self.index, "port": self.port,
                "device_indexes": list(self.device_indexes),
                "devices": [str(d) for d in getattr(eng, "devices", [])],
                "worker_state": self._state, "restart_count": self.restart_count}

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> EngineWorker:
        """Build and warm up the engine (blocks; the caller picks the thread)."""
        assert self._engine is None and self._state == "starting", self._state
        self._build()
        return self

    def _build(self) -> None:
        t0 = time.monotonic()
        try:
            engine = self._factory(self.config)
        except Exception as exc:
            with self._lock:
                if self._state != "stopped":
                    self._state = "failed"
                    self._reason = f"engine build failed: {type(exc).__name__}: {exc}"
            raise
        with self._lock:
            stopped = self._state == "stopped"  # shut down while this engine was building
            if not stopped:
                self._engine = engine
                self._model_name = engine.model_name
                self._context_len = engine.context_len
                if self._tokenizer is None:
                    self._tokenizer = engine.tokenizer
                    self.tokenizer_dir = engine.tokenizer_dir
                    self.model_path = engine.model_path
                self._state = "ready"
                self._reason = "ok"
        if stopped:
            engine.shutdown()
            raise RuntimeError(f"engine {self.index} was shut down while it was being built")
        self.build_seconds = time.monotonic() - t0

    def restart(self) -> ControlResult:
        """Shut the current engine down and build a new one on the same devices.

        Compiled shapes come back from JAX's persistent compilation cache when the
        launcher enabled it, so a restart costs loading weights, not recompiling."""
        with self._lock:
            if self._state in ("starting", "restarting"):
                return ControlResult(False, f"engine {self.index} is {self._state}")
            if self._state == "stopped":
                return ControlResult(False, f"engine {self.index} is shut down")
            if self._engine is not None and _spans_hosts(self._engine):
                return ControlResult(False, f"engine {self.index} spans hosts: restart the "
                                     "whole slice (sops/run-multi-host.md)",
                                     {"refused": "spans_hosts"})
            old, self._engine = self._engine, None
            previous = old.health()[1] if old is not None else self._reason
            self._state = "restarting"
            self._reason = f"restarting (was: {previous})"
        if old is not None:
            old.shutdown()
            del old
        try:
            self._build()
        except Exception as exc:  # noqa: BLE001 - reported; the slot stays failed
            return ControlResult(False, self._reason, {"error": f"{type(exc).__name__}: {exc}"})
        self.restart_count += 1
        return ControlResult(True, f"engine {self.index} restarted on devices "
                             f"{list(self.device_indexes)}",
                             {"previous_reason": previous,
                              "build_seconds": round(self.build_seconds or 0.0, 3)})

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the engine has compiled every step program (it serves before that;
        EngineConfig.compile_in_background). True also for an engine without the notion."""
        engine = self._engine
        wait = getattr(engine, "wait_compiled", None)
        return True if wait is None else bool(wait(timeout))

    def begin_drain(self) -> None:
        """Refuse new requests from now on (shutdown); in-flight ones go on."""
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Block until no stream is in flight through this worker (or the timeout)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._active_streams == 0, timeout)

    @property
    def active_streams(self) -> int:
        return self._active_streams

    def shutdown(self) -> None:
        with self._lock:
            old, self._engine = self._engine, None
            self._state = "stopped"
            self._reason = "engine is shut down"
        if old is not None:
            old.shutdown()

    # ---- EngineClient ----------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        with self._lock:
            state, reason, engine, draining = (self._state, self._reason, self._engine,
                                               self._draining)
        if state != "ready" or engine is None:
            return False, reason
        if draining:
            return False, "shutting down: not accepting new requests"
        return engine.health()

    def accepts_work(self) -> tuple[bool, str]:
        """Whether a request sent now would run now (Engine.accepts_work): what the
        fleet's front door routes by."""
        ok, reason = self.health()
        engine = self._engine
        if not ok or engine is None:
            return False, reason
        return engine.accepts_work()

    def _live_engine(self) -> Any:
        ok, reason = self.health()
        engine = self._engine
        if not ok or engine is None:
            raise EngineUnavailable(reason)
        return engine

    def _engine_for_control(self) -> Any:
        engine = self._engine
        if engine is None:
            raise EngineUnavailable(self._reason)
        return engine

    async def open_streams(self, requests: Sequence[GenerateRequest]) -> list[Any]:
        """Admit `requests` atomically on the engine (see `Engine.open_streams`); each
        stream counts as in flight until it ends or is closed."""
        engine = self._live_engine()
        with self._lock:
            self._active_streams += len(requests)
        try:
            streams = await engine.open_streams(requests)
        except BaseException:
            for _ in requests:
                self._stream_ended()
            raise
        for st in streams:
            st.add_done_callback(self._stream_ended)
        return streams

    def _stream_ended(self) -> None:
        with self._idle:
            self._active_streams -= 1
            self._idle.notify_all()

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        """Every control operation (control_ops.py), forwarded to the engine in the slot;
        get_internal_state adds the slot's identity."""
        result = await self._engine_for_control().acontrol(name, **args)
        return {**result, **self.identity()} if name == "get_internal_state" else result

    # ---- sync helpers (launcher, tests) ----------------------------------------------
    def abort_all(self) -> ControlResult | None:
        engine = self._engine
        return None if engine is None else engine.abort_request(None, abort_all=True)

    def get_internal_state(self) -> dict[str, Any]:
        return {**self._engine_for_control().get_internal_state(), **self.identity()}

    def __repr__(self) -> str:
        return (f"EngineWorker(index={self.index}, devices={list(self.device_indexes)}, "
                f"port={self.port}, state={self._state})")


def _spans_hosts(engine: Any) -> bool:
    """The engine has devices of another host (multiserve/multihost/): its followers hold
    a runner built once, so it cannot be rebuilt alone."""
    from multiserve.multihost.session import current, spans_hosts

    return current() is not None and spans_hosts(list(engine.devices))
