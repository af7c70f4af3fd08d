"""A real HTTP server (multiserve.server.build_app) for an engine the caller owns, on
loopback: shared by the server, reliability and plugin tests (tests/ is on sys.path
through its conftest)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def engine_server(engine: Any) -> Iterator[str]:
    """Yields the url of a server for `engine` whose TokenizerManager uses the engine's own
    tokenizer; the server is stopped on exit, the engine is left running."""
    from multiserve.server import ServerThread, TokenizerManager, build_app

    tm = TokenizerManager(engine.tokenizer_dir, engine.context_len, engine.model_name,
                          tokenizer=engine.tokenizer)
    thread = ServerThread(build_app(engine, tm)).start()
    try:
        yield thread.url
    finally:
        thread.stop()
