"""The shipped fleet's memory from a fresh start (docs/performance.md §26).

Usage: python scripts/fleet_memory.py TREE HOME OUT.json

Starts `multiserve serve --config configs/cpu-4.toml` of the source tree TREE (on
PYTHONPATH), HOME set to HOME (an empty directory: no kernel, calibration or compile
cache, so the calibration is fresh) and MALLOC_ARENA_MAX=2 (as scripts/fleet.sh), then
reads the
process's VmRSS / VmHWM at READY, once every engine's step programs are compiled, and
after 2 rounds of 16 concurrent 200-token chats (4 a port); writes them, every engine's
"memory" and "determinism" blocks and the supervisor's /get_server_info to OUT.json. Uses
ports 31000-31003 and 31100 (check `ss -ltnp` first). Run it under
`flock /tmp/bench.lock`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

PORTS = [31000 + i for i in range(4)]
SUPERVISOR = 31100


def vm(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of process `pid`, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def engine_state(port: int) -> dict[str, Any]:
    info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json()
    return info["internal_states"][0]


def chat(i: int) -> int:
    body = {"model": "default", "max_tokens": 200, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user",
                          "content": f"Tell me a long story about the number {i}."}]}
    r = httpx.post(f"http://127.0.0.1:{PORTS[i % 4]}/v1/chat/completions", json=body,
                   timeout=600)
    return r.status_code


def main(tree: str, home: str, out: str) -> None:
    env = {**os.environ, "HOME": home, "PYTHONPATH": tree, "MALLOC_ARENA_MAX": "2"}
    for key in ("MULTISERVE_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "MULTISERVE_JAX_CACHE"):
        env.pop(key, None)
    os.makedirs(home, exist_ok=True)
    start = time.time()
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "multiserve.cli", "serve", "--config",
                                 f"{tree}/configs/cpu-4.toml"], cwd=tree, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        result: dict[str, Any] = {"tree": tree}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("READY"):
                    break
            result["ready_s"] = time.time() - start
            result["at_ready"] = vm(proc.pid)
            while not all(engine_state(p)["compile"]["complete_s"] is not None
                          for p in PORTS):
                time.sleep(5)
            result["compiled_s"] = time.time() - start
            result["all_compiled"] = vm(proc.pid)
            with ThreadPoolExecutor(16) as pool:
                result["codes"] = [list(pool.map(chat, range(16))) for _ in range(2)]
            result["after_load"] = vm(proc.pid)
            result["engines"] = [{k: engine_state(p)[k] for k in ("memory", "determinism")}
                                 for p in PORTS]
            result["supervisor"] = httpx.get(
                f"http://127.0.0.1:{SUPERVISOR}/get_server_info", timeout=30).json()
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({k: result.get(k) for k in ("ready_s", "compiled_s", "at_ready",
                                                 "all_compiled", "after_load")}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
