"""`multiserve validate --force-exit` as a real subprocess, plus the shutdown paths of
`multiserve serve` (SIGTERM -> clean exit 0).

Runs configs/cpu-4.toml with ephemeral ports (`--port 0 --supervisor-port 0`) and a
smaller KV pool (a temp copy of the config), the same as the in-process fleet tests use, so
compiled shapes come from the suite's persistent compilation cache. The one-engine tests of
the exit paths also take test_fleet_four.py's one bucket pair.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = (REPO / "configs" / "cpu-4.toml").read_text()
    small, n = re.subn(r"(?m)^max_total_tokens\s*=.*$", "max_total_tokens = 4096", text)
    assert n == 1
    path = tmp_path_factory.mktemp("cfg") / "cpu-4.toml"
    path.write_text(small + '\n')
    return path


@pytest.fixture(scope="module")
def one_bucket_config(config: Path) -> Path:
    """`config` with test_fleet_four.py's one bucket pair (its programs come from the
    persistent compilation cache): for the tests of the CLI's exit paths, which check
    exit codes, results and signals, not the buckets (those run above, as shipped)."""
    text = config.read_text()
    for key, value in (("precompile_bs_paddings", "[8]"), ("precompile_token_paddings", "[64]"),
                       ("chunked_prefill_size", "64"), ("max_running_requests", "8")):
        text, n = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text)
        assert n == 1, key
    path = config.with_name("cpu-4-one-bucket.toml")
    path.write_text(text)
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "multiserve.cli", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def run_validate(config: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        cli("validate", "--config", str(config), "--port", "0", "--supervisor-port", "0",
            "--force-exit", "--max-tokens", "16", "--timeout", str(TIMEOUT_S - 30), *extra),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=REPO)
    return proc, time.monotonic() - t0


def test_validate_force_exit_passes_on_the_default_config(config: Path) -> None:
    proc, wall = run_validate(config)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert re.search(r"^READY: servers=4 ports=\[\d+,\d+,\d+,\d+\] "
                     r"devices=\[\[0\],\[1\],\[2\],\[3\]\]", out, re.M), out
    resp = re.findall(r"^RESP: port=(\d+) status=(\d+) latency_sec=[\d.]+ text=(.+)$", out, re.M)
    assert len(resp) == 8 and {s for _, s, _ in resp} == {"200"}
    assert len({p for p, _, _ in resp}) == 4 and len({t for _, _, t in resp}) == 1
    assert re.search(r"^DONE: servers=4 wall_sec=[\d.]+ max_req_sec=[\d.]+ sum_req_sec=[\d.]+",
                     out, re.M), out
    assert "CHECK: name=concurrent ok=True" in out
    assert out.rstrip().endswith("RESULT: PASS")
    print(f"validate (4 engines) took {wall:.1f} s")


def test_validate_force_exit_fails_when_a_check_fails(one_bucket_config: Path) -> None:
    proc, _ = run_validate(one_bucket_config, "--engines", "1", "--inject-failure")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "CHECK: name=all_answered ok=True" in out
    assert "CHECK: name=identical_greedy ok=False" in out
    assert out.rstrip().endswith("RESULT: FAIL")


def test_serve_stops_cleanly_on_sigterm(one_bucket_config: Path, tmp_path: Path) -> None:
    stderr = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        cli("serve", "--config", str(one_bucket_config), "--engines", "1", "--port", "0",
            "--supervisor-port", "0", "--shutdown-mode", "drain"),
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env(), cwd=REPO)
    try:
        line = ""
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the fleet prints READY (or exits)
            if line.startswith("READY:"):
                break
        m = re.match(r"READY: servers=1 ports=\[(\d+)\] devices=\[\[0\]\] "
                     r"supervisor_port=(\d+)", line)
        assert m, line + (tmp_path / "stderr.txt").read_text()[-3000:]
        port, sup_port = m.groups()
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{sup_port}/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
