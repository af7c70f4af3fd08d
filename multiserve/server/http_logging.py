"""uvicorn's loggers, set up without touching anyone else's logging.

uvicorn's default `Config(log_config=LOGGING_CONFIG)` runs `logging.config.dictConfig`,
which *closes every handler already installed in the process* before it installs its
own. multiserve runs inside other programs (RL trainers, notebooks, pytest) and starts
one uvicorn server per engine, so that would tear down the host's logging each time a
server starts; absl's handler (installed by JAX) even closes its stream when it is not
the current `sys.stderr` at that moment, which under pytest's capture is the capture
file itself. So every server is created with `log_config=None` and this module gives
the `uvicorn` loggers a handler once.

Invariants: handlers are added only to loggers that have none (a user's own logging
configuration wins); the handler writes to whatever `sys.stderr` / `sys.stdout` is at
the time of the record, never to a stream captured when the server started.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

_lock = threading.Lock()
_FORMAT = "%(levelname)s:     [%(name)s] %(message)s"


class CurrentStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler bound to the current `sys.stderr` (or `sys.stdout`) at each record."""

    def __init__(self, stdout: bool = False) -> None:
        super().__init__()
        self._stdout = stdout

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout if self._stdout else sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # StreamHandler.__init__ assigns it
        pass

    def close(self) -> None:  # the process's standard streams are not ours to close
        logging.Handler.close(self)


def configure_uvicorn_logging() -> None:
    """Give `uvicorn` (errors) and `uvicorn.access` a handler if they have none."""
    with _lock:
        for name, stdout in (("uvicorn", False), ("uvicorn.access", True)):
            logger = logging.getLogger(name)
            if logger.handlers:
                continue
            handler = CurrentStreamHandler(stdout=stdout)
            handler.setFormatter(logging.Formatter(_FORMAT))
            logger.addHandler(handler)
            logger.propagate = False
