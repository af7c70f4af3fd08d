"""Starting a server leaves the process's logging alone: uvicorn's default config would
close every handler already installed (a trainer's log file, absl's stream under pytest
capture) — the CI run once died of exactly that."""

from __future__ import annotations

import io
import logging

import httpx

from multiserve.server.server_thread import ServerThread


async def _app(scope, receive, send):  # type: ignore[no-untyped-def]
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class _FileLikeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Closes its stream on close(), as logging.FileHandler and absl's handler do."""

    def close(self) -> None:
        self.stream.close()
        super().close()


def test_server_start_keeps_existing_handlers_open() -> None:
    stream = io.StringIO()
    handler = _FileLikeHandler(stream)
    owner = logging.getLogger("a.host.application")
    owner.addHandler(handler)
    try:
        with ServerThread(_app) as server:
            assert httpx.get(f"{server.url}/").text == "ok"
        owner.warning("still here")
        assert not stream.closed
        assert "still here" in stream.getvalue()
    finally:
        owner.removeHandler(handler)


def test_uvicorn_logs_go_to_the_current_stderr(capsys) -> None:  # type: ignore[no-untyped-def]
    with ServerThread(_app):
        pass
    logging.getLogger("uvicorn.error").warning("a uvicorn warning")
    assert "a uvicorn warning" in capsys.readouterr().err
