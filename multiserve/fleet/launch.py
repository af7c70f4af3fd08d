"""The fleet in one process: JAX once, N engine workers, N HTTP servers, one supervisor.

Owns: start-up in order (`launch_fleet` -> `Fleet`: platform and JAX, device check,
port check, compilation cache, workers with their warm-up and a progress display, one
server per engine, the supervisor, readiness), the READY line, the shutdown order
(`Fleet.stop`), and `multiserve serve` (`serve_main`). The steps before any engine
exists live in `startup.py`; `multiserve validate` lives in `validate.py`.

Invariants (docs/architecture.md §3):
- JAX is initialised once, by `startup.init_jax`, before any engine exists. Nothing here
  assumes a platform: devices are `jax.devices()[i]` for the configured indexes.
- Every server runs in its own thread without signal handlers; `serve_main` installs
  SIGINT/SIGTERM handlers in the main thread only.
- READY is printed only after every server (engines and supervisor) answered
  GET /health with 200: readiness is observed, never assumed after a sleep.
- A non-loopback bind without an API key is logged as a WARNING before any engine is
  built; with a key, every engine and supervisor route requires it.
- Shutdown order: refuse new requests, drain (bounded) or abort in-flight work, stop
  the servers, then the engines. `Fleet.stop` is idempotent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from multiserve.config import ConfigError, FleetConfig
from multiserve.fleet.config_loader import validate_against_devices
from multiserve.fleet.startup import (
    check_ports_free,
    enable_compilation_cache,
    fleet_config_from_args,
    init_jax,
)
from multiserve.fleet.worker import EngineWorker
from multiserve.host.heap import release_free_heap
from multiserve.types import ControlResult

HEALTH_TIMEOUT_S = 120.0


class LaunchCancelled(RuntimeError):
    """A stop signal arrived while the fleet was starting."""


# ---- the running fleet ----------------------------------------------------------------

@dataclass
class Fleet:
    """A started fleet: workers[i] is served by servers[i]; `supervisor` drives them all."""

    config: FleetConfig
    workers: list[EngineWorker]
    servers: list[Any] = field(default_factory=list)  # multiserve.server.ServerThread
    supervisor: Any = None
    front_door: Any = None  # the fleet's one routed port (FleetConfig.front_door), or None
    compilation_cache: str | None = None
    # a slice of several hosts (multiserve/multihost/): closed after the engines stop
    slice_session: Any = None
    _stopped: bool = False

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def supervisor_port(self) -> int:
        return self.supervisor.port

    @property
    def supervisor_url(self) -> str:
        return self.supervisor.url

    @property
    def front_door_url(self) -> str | None:
        return self.front_door.url if self.front_door is not None else None

    @property
    def device_groups(self) -> list[list[int]]:
        return [list(w.device_indexes) for w in self.workers]

    def ready_line(self) -> str:
        ports = ",".join(str(p) for p in self.ports)
        devices = ",".join("[" + ",".join(map(str, g)) + "]" for g in self.device_groups)
        door = f" front_door_port={self.front_door.port}" if self.front_door else ""
        return (f"READY: servers={len(self.servers)} ports=[{ports}] devices=[{devices}] "
                f"supervisor_port={self.supervisor_port}{door}")

    async def restart_engine(self, i: int) -> ControlResult:
        """The supervisor's restart callback: rebuild engine i off the event loop."""
        return await asyncio.to_thread(self.workers[i].restart)

    def stop(self, mode: str = "abort", drain_timeout: float = 60.0,
             log: TextIO | None = None) -> None:
        """Refuse new work; `drain`: wait (bounded) for in-flight requests, `abort`: end
        them now; stop the servers, then the engines. Idempotent."""
        assert mode in ("drain", "abort"), mode
        if self._stopped:
            return
        self._stopped = True
        for w in self.workers:
            w.begin_drain()
        if mode == "drain":
            deadline = time.monotonic() + drain_timeout
            for w in self.workers:
                if not w.wait_idle(max(0.0, deadline - time.monotonic())):
                    _say(log, f"engine {w.index}: {w.active_streams} request(s) still running "
                              f"after {drain_timeout:g} s; aborting them")
        for w in self.workers:
            try:
                w.abort_all()
            except Exception:  # noqa: BLE001 - a broken engine still gets shut down
                pass
        for s in [self.front_door, *self.servers, self.supervisor]:
            if s is not None:
                s.stop()
        for w in self.workers:
            w.shutdown()
        if self.slice_session is not None and self.slice_session.leader is not None:
            self.slice_session.leader.close()  # the followers exit (0)


def _message(e: ConfigError) -> str:
    prefix = f"config field '{e.field}': "
    return str(e)[len(prefix):] if str(e).startswith(prefix) else str(e)


def _say(out: TextIO | None, text: str) -> None:
    out = out or sys.stderr
    print(text, file=out, flush=True)


def launch_fleet(cfg: FleetConfig, *, announce: bool = True, out: TextIO | None = None,
                 log: TextIO | None = None, cancelled: Callable[[], bool] | None = None,
                 health_timeout: float = HEALTH_TIMEOUT_S) -> Fleet:
    """Start everything `cfg` describes in this process and return once it all serves.

    `announce` prints the READY line to `out` (stdout); progress goes to `log` (stderr).
    `cancelled` is polled between start-up stages (a stop signal during warm-up)."""
    session = None
    if cfg.multihost.enabled:
        from multiserve.fleet.slice_start import form_slice

        session = form_slice(cfg)  # JAX starts over every host's devices
    devices = init_jax(cfg.platform, cfg.device_count_needed)
    try:
        validate_against_devices(cfg, len(devices))
    except ConfigError as e:
        if devices[0].platform != "cpu":
            raise
        raise ConfigError(e.field, f"{_message(e)} (on CPU the fleet asks for "
                          f"{cfg.device_count_needed} virtual devices, but JAX started "
                          f"earlier or XLA_FLAGS set another count)") from None
    from multiserve.server.auth import warn_if_exposed

    for host in sorted({s.host for s in (*cfg.servers, cfg.supervisor, cfg.front_door)
                        if s is not None}):
        warn_if_exposed(host, cfg.api_key)  # a non-loopback bind without a key
    check_ports_free(cfg)
    cache = enable_compilation_cache()
    _say(log, f"fleet: {len(cfg.engines)} engine(s) on {devices[0].platform} devices "
              f"{[list(e.device_indexes) for e in cfg.engines]}; compilation cache: "
              f"{cache or 'off'}")
    workers = [EngineWorker(i, e) for i, e in enumerate(cfg.engines)]
    fleet = Fleet(cfg, workers, compilation_cache=cache, slice_session=session)
    if session is not None:
        from multiserve.fleet.slice_start import watch_slice

        watch_slice(session, workers)
    try:
        from multiserve.engine.device.programs import background_compiles_held

        with background_compiles_held():  # every engine serving first, the small buckets after
            _build_workers(workers, cfg.warmup_parallel, log, cancelled)
        # warm-up's compiler scratch, GBs on a 4-engine fleet (each engine trims again when
        # its background compiles end)
        trimmed = release_free_heap()
        if trimmed:
            _say(log, "fleet: returned the warm-up's free heap to the OS")
        _start_servers(fleet)
        door = [fleet.front_door_url] if fleet.front_door_url else []
        _wait_healthy([*fleet.urls, fleet.supervisor_url, *door], health_timeout,
                      api_key=cfg.api_key)
    except BaseException:
        fleet.stop("abort")
        raise
    if announce:
        print(fleet.ready_line(), file=out or sys.stdout, flush=True)
    _log_when_compiled(workers, log)
    return fleet


def _log_when_compiled(workers: list[EngineWorker], log: TextIO | None) -> None:
    """Say on `log` when every engine has compiled its smaller step programs too (they
    compile in the background after READY: engine/device/programs.py)."""
    t0 = time.monotonic()

    def wait() -> None:
        for w in workers:
            w.wait_compiled()
        _say(log, f"fleet: every engine's step programs compiled "
                  f"({time.monotonic() - t0:.1f} s after READY)")

    threading.Thread(target=wait, name="fleet-compiled", daemon=True).start()


def _build_workers(workers: list[EngineWorker], parallel: bool, log: TextIO | None,
                   cancelled: Callable[[], bool] | None) -> None:
    n = len(workers)
    t0 = time.monotonic()

    def build(w: EngineWorker) -> None:
        _say(log, f"fleet: engine {w.index + 1}/{n} devices={list(w.device_indexes)}: "
                  f"building and warming up")
        w.start()
        _say(log, f"fleet: engine {w.index + 1}/{n} ready ({w.build_seconds:.1f} s)")

    if parallel:
        errors: list[BaseException] = []

        def run(w: EngineWorker) -> None:
            try:
                build(w)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)

        threads = [threading.Thread(target=run, args=(w,), name=f"warmup-{w.index}")
                   for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    else:
        for w in workers:
            if cancelled is not None and cancelled():
                raise LaunchCancelled("stop requested during warm-up")
            build(w)
    _say(log, f"fleet: {n} engine(s) ready in {time.monotonic() - t0:.1f} s "
              f"({'parallel' if parallel else 'sequential'} warm-up)")


def _start_servers(fleet: Fleet) -> None:
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_lora import add_lora_supervisor_routes
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
    from multiserve.fleet.supervisor_vllm import add_vllm_pause_supervisor_routes
    from multiserve.fleet.supervisor_weights import add_weight_session_supervisor_routes
    from multiserve.server import ServerThread, TokenizerManager, build_app
    from multiserve.server.auth import protect
    from multiserve.server.control_routes import add_rl_routes
    from multiserve.server.weight_transfer import add_weight_transfer_routes

    cfg = fleet.config
    for w, scfg in zip(fleet.workers, cfg.servers, strict=True):
        # the engine's own tokenizer instance (one per engine), not a second load
        tm = TokenizerManager(w.tokenizer_dir, w.context_len, w.model_name,
                              tokenizer=w.tokenizer,
                              chat_template=read_chat_template(scfg.chat_template))
        info = {"engine_index": w.index, "device_indexes": list(w.device_indexes),
                "model_path": str(w.model_path),
                "tokenizer_path": str(w.tokenizer_dir)}
        app = build_app(w, tm, server_info=info, max_request_bytes=scfg.max_request_bytes,
                        enable_memory_saver=scfg.enable_memory_saver,
                        tool_call_parser=scfg.tool_call_parser,
                        reasoning_parser=scfg.reasoning_parser)
        add_rl_routes(app, w)  # release/resume memory, weight updates (per engine)
        add_weight_transfer_routes(app)  # vLLM's / SGLang's transfer set-up: what we honour
        protect(app, cfg.api_key)  # every route, when a key is set
        server = ServerThread(app, scfg.host, scfg.port, name=f"engine-{w.index}-http")
        w.port = server.port
        app.state.server_info.update(host=scfg.host, port=server.port)  # /get_server_info
        fleet.servers.append(server.start())
    sup_app = build_supervisor_app(fleet.workers, restart=fleet.restart_engine,
                                   engine_ports=fleet.ports,
                                   max_request_bytes=cfg.supervisor.max_request_bytes,
                                   enable_memory_saver=cfg.supervisor.enable_memory_saver)
    add_rl_supervisor_routes(sup_app)  # fleet-wide two-phase weight updates, memory
    add_lora_supervisor_routes(sup_app)  # LoRA adapters on every engine, all or none
    add_vllm_pause_supervisor_routes(sup_app)  # vLLM's /pause, /resume, /is_paused
    add_weight_session_supervisor_routes(sup_app)  # the weight-update session, all or none
    add_weight_transfer_routes(sup_app)
    protect(sup_app, cfg.api_key)
    fleet.supervisor = ServerThread(sup_app, cfg.supervisor.host, cfg.supervisor.port,
                                    name="supervisor-http").start()
    if cfg.front_door is not None:
        fleet.front_door = _start_front_door(fleet)


def _start_front_door(fleet: Fleet) -> Any:
    """One OpenAI/SGLang port routing to every engine's port (fleet/front_door.py)."""
    from multiserve.fleet.front_door import build_front_door_app
    from multiserve.fleet.front_door_openapi import document_front_door
    from multiserve.server import ServerThread
    from multiserve.server.auth import protect

    cfg = fleet.config
    assert cfg.front_door is not None
    first = fleet.workers[0]
    app = build_front_door_app(
        fleet.workers, lambda: fleet.urls, routing=cfg.routing, api_key=cfg.api_key,
        max_request_bytes=cfg.front_door.max_request_bytes,
        document=document_front_door(first.model_name, len(first.tokenizer)))
    protect(app, cfg.api_key)
    return ServerThread(app, cfg.front_door.host, cfg.front_door.port,
                        name="front-door-http").start()


def read_chat_template(path: str | None) -> str | None:
    """The text of a --chat-template file (ConfigError naming the option if unreadable)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("fleet.chat_template", f"cannot read {path}: {e}") from None


def _wait_healthy(urls: list[str], timeout: float, api_key: str | None = None) -> None:
    """Poll GET /health on every URL until each answers 200 (TimeoutError otherwise)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    deadline = time.monotonic() + timeout
    pending = list(urls)
    last: dict[str, str] = {}
    with httpx.Client(timeout=5.0, headers=headers) as client:
        while pending:
            for url in list(pending):
                try:
                    r = client.get(f"{url}/health")
                    if r.status_code == 200:
                        pending.remove(url)
                        continue
                    last[url] = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    last[url] = f"{type(e).__name__}: {e}"
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:g} s: "
                                   + "; ".join(f"{u} ({last.get(u)})" for u in pending))
            if pending:
                time.sleep(0.05)


# ---- multiserve serve ------------------------------------------------------------------

def install_stop_handlers(stop: threading.Event) -> None:
    """SIGINT/SIGTERM set `stop`; a second signal ends the process at once. Main thread
    only (Python allows signal handlers nowhere else)."""
    assert threading.current_thread() is threading.main_thread()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            print(f"{signal.Signals(signum).name} again: exiting now", file=sys.stderr,
                  flush=True)
            os._exit(1)
        print(f"{signal.Signals(signum).name}: shutting down", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def serve_main(args: argparse.Namespace) -> int:
    """`multiserve serve`: run the fleet until SIGINT/SIGTERM, then shut down cleanly."""
    try:
        cfg = fleet_config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.multihost.enabled and not cfg.multihost.is_leader:
        return follow_main(cfg)
    stop = threading.Event()
    install_stop_handlers(stop)
    from multiserve.multihost.link import SliceStartError

    try:
        fleet = launch_fleet(cfg, cancelled=stop.is_set)
    except LaunchCancelled:
        return 0
    except (ConfigError, SliceStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        if cfg.multihost.enabled:  # not JAX's exit barrier: a host may never have come
            sys.stderr.flush()
            os._exit(2)
        return 2
    while not stop.wait(1.0):
        pass
    mode = getattr(args, "shutdown_mode", "abort") or "abort"
    fleet.stop(mode)
    print(f"stopped ({mode})", file=sys.stderr, flush=True)
    if cfg.multihost.enabled:  # the followers have left: JAX's exit barrier would wait
        sys.stderr.flush()
        os._exit(0)
    return 0


def follow_main(cfg: FleetConfig) -> int:
    """`multiserve serve | validate --node-rank R` (R > 0): follow node 0 until it closes the slice
    (0), is lost (3), or refuses this host (2). Exits without JAX's exit barrier."""
    from multiserve.fleet.slice_start import follow_fleet, form_slice
    from multiserve.multihost.link import SliceStartError

    try:
        code = follow_fleet(cfg, form_slice(cfg))
    except (ConfigError, SliceStartError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stderr.flush()
    os._exit(code)


__all__ = ["Fleet", "LaunchCancelled", "follow_main", "launch_fleet", "serve_main"]
