"""Python's collector thresholds (multiserve/host/collector.py): set by the processes multiserve
owns (its command line), never by importing the library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from multiserve.host.collector import GC_THRESHOLDS

REPO = Path(__file__).resolve().parents[1]

# a fresh interpreter: the library imported (engine and HTTP side), then the command line run
SCRIPT = """
import contextlib, gc, io, json
before = gc.get_threshold()
import multiserve, multiserve.engine.engine, multiserve.server.app
imported = gc.get_threshold()
from multiserve.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["--help"])
    except SystemExit:
        pass
print(json.dumps([before, imported, gc.get_threshold()]))
"""


def test_the_command_line_sets_the_thresholds_and_an_import_does_not() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True)
    before, imported, after_cli = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == before  # a library import leaves the interpreter's collector alone
    assert tuple(after_cli) == GC_THRESHOLDS != tuple(before)
