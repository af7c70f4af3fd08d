"""Starting the hosts of a test slice as processes on loopback (tests/multihost/).

`run_slice` runs tests/multihost/node.py once per rank (rank 0 last, in the foreground
of the wait) and returns the leader's JSON; `serve_host` starts `multiserve serve` for
one rank. Every process gets its own virtual CPU devices and a fresh port pair.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NODE = Path(__file__).with_name("node.py")
WAIT_S = 300.0  # upper bound of any slice run here (never reached when healthy)


def free_port_pair() -> int:
    """A port P with P + 1 also free (the coordinator and the step stream)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def env(**extra: str) -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}
    out.pop("XLA_FLAGS", None)  # each process sets its own device count
    return out


def run_slice(tmp: Path, scenario: str, nnodes: int, model: Path, **extra: str
              ) -> dict[str, Any]:
    """Run `scenario` on a slice of `nnodes` processes (0: the one-process reference) and
    return what the leader wrote; every process must exit 0."""
    port = free_port_pair()
    addr = f"127.0.0.1:{port}"
    out = tmp / f"{scenario}-{nnodes}-{port}.json"
    procs = []
    for rank in [*range(1, nnodes), 0]:
        log = open(tmp / f"node{rank}-{port}.log", "w")
        procs.append((rank, log, subprocess.Popen(
            [sys.executable, str(NODE), scenario, str(rank), str(nnodes), addr, str(model),
             str(out)], env=env(**extra), stdout=log, stderr=subprocess.STDOUT)))
    codes = {}
    for rank, log, proc in procs:
        try:
            codes[rank] = proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = {r: (tmp / f"node{r}-{port}.log").read_text()[-3000:] for r, _, _ in procs}
    assert all(c == 0 for c in codes.values()), (codes, logs)
    return json.loads(out.read_text())


def serve_host(tmp: Path, config: Path, nnodes: int, rank: int, port: int,
               *args: str) -> tuple[subprocess.Popen[str], Path]:
    """`multiserve serve --config CONFIG --nnodes N --node-rank R --dist-init-addr ...` as
    a process; its stdout (READY / FOLLOWING lines) and stderr go to one log file."""
    log_path = tmp / f"serve{rank}-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "multiserve.cli", "serve", "--config", str(config),
         "--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr",
         f"127.0.0.1:{port}", *args], env=env(), stdout=log, stderr=subprocess.STDOUT,
        text=True)
    log.close()
    return proc, log_path
