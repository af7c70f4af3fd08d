"""Running an app under uvicorn in a background thread (the fleet, tests).

Owns: `ServerThread` (bind → start → `ready` event → `stop()`).

Invariants: the listening socket is bound before the thread starts, so `port` is
known at once (port 0 picks a free one) and early connections wait in the backlog;
`ready` is set only after uvicorn finished its startup; a server thread never installs
signal handlers (only the main thread may); `stop()` returns once the thread ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from multiserve.server.http_logging import configure_uvicorn_logging

log = logging.getLogger("multiserve.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready: threading.Event) -> None:
        super().__init__(config)
        self._ready = ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # a server thread never installs signal handlers (the main thread owns them)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._ready.set()


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """One uvicorn server for `app` in a daemon thread with its own event loop."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", name: str = "multiserve-http",
                 graceful_timeout_s: float = 5.0) -> None:
        self.host = host
        self.ready = threading.Event()
        self._sock = bind_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        configure_uvicorn_logging()
        # log_config=None: uvicorn's own dictConfig would close the process's existing
        # logging handlers (see http_logging).
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", log_config=None,
                                timeout_graceful_shutdown=graceful_timeout_s,
                                timeout_keep_alive=30)
        self._server = _Server(config, self.ready)
        self._thread = threading.Thread(target=self._run, name=f"{name}:{self.port}",
                                        daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 - reported through start()/error
            self.error = exc
            log.exception("server thread %s failed", self._thread.name)
        finally:
            self.ready.set()  # never leave a waiter hanging
            with contextlib.suppress(OSError):
                self._sock.close()

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        if not self.ready.wait(timeout):
            raise TimeoutError(f"server on port {self.port} not ready after {timeout}s")
        if self.error is not None or not self._server.started:
            raise RuntimeError(f"server on port {self.port} failed to start: {self.error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.ident is None:  # never started: just release the port
            with contextlib.suppress(OSError):
                self._sock.close()
            return
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # graceful shutdown stuck: force it
            self._server.force_exit = True
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self._server.started

    def __enter__(self) -> ServerThread:
        return self if self.ready.is_set() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
