"""Tunix's GRPO learner with multiserve as its rollout (tests/plugins/test_tunix_rollout.py),
run in the venv of its own that scripts/tunix-env.sh builds (.venv-tunix: google-tunix and
the test extra's transformers do not install together). scripts/test.sh builds it in the
background while the suite runs and this test waits for it; the build's outcome is in
.venv-tunix.status ("building", "ready", "failed"). Where no build was started (a plain
pytest run without scripts/test.sh), the test is skipped, naming the script."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATUS = REPO / ".venv-tunix.status"
LOG = REPO / ".venv-tunix.log"
PYTHON = REPO / ".venv-tunix" / "bin" / "python"
BUILD_TIMEOUT_S = 900.0


def _status() -> str:
    return STATUS.read_text().strip() if STATUS.exists() else ""


def test_tunix_grpo_with_multiserve_rollout_in_its_venv() -> None:
    if "tunix" in sys.modules or _status() == "":
        pytest.skip("no .venv-tunix build: run scripts/tunix-env.sh (scripts/test.sh does)")
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while _status() == "building" and time.monotonic() < deadline:
        time.sleep(2.0)
    log = LOG.read_text()[-4000:] if LOG.exists() else ""
    assert _status() == "ready", f".venv-tunix build: {_status()!r}\n{log}"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/plugins/test_tunix_rollout.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, out
    assert "1 passed" in run.stdout, out
