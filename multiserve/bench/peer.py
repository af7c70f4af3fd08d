"""Runs a benchmark peer (plugins/peers/<name>_generate.py) in a subprocess and reads its
JSON line.

torch, vLLM and llama.cpp never enter the multiserve process: each peer runs with its
own interpreter, `.venv-peers/<name>/bin/python` (made by `scripts/peer-envs.sh <name>`;
`$MULTISERVE_PEER_ENVS` moves that folder), with the multiserve checkout on its
PYTHONPATH (the peers import plugins.peers.protocol and multiserve.bench.stats, both
pure Python) and the extra variables of `.venv-peers/<name>/peer.env` (KEY=VALUE lines,
e.g. vLLM's LD_PRELOAD) unless the caller's environment already sets them. The `hf`
peer falls back to this interpreter when it has no env of its own (multiserve's
`bench` extra installs torch). The peer gets the exact token-id prompts (and the
sampling: temperature, base seed) through a temporary JSON file and its arguments, and
prints one JSON line on stdout (protocol:
plugins/peers/protocol.py). A progress line shows elapsed time; its stderr passes
through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parents[2]
PLUGINS_DIR = REPO_DIR / "plugins" / "peers"
PEERS = ("hf", "vllm", "llamacpp")
ENVS_VAR = "MULTISERVE_PEER_ENVS"


class PeerError(RuntimeError):
    """The peer could not run (no env, script missing, crashed, or printed no result)."""


def peer_envs_dir() -> Path:
    return Path(os.environ.get(ENVS_VAR) or REPO_DIR / ".venv-peers")


def peer_script(name: str) -> Path:
    path = PLUGINS_DIR / f"{name}_generate.py"
    if not path.is_file():
        raise PeerError(f"peer script {path} not found (run from a source checkout)")
    return path


def peer_python(name: str) -> str:
    """The peer's own interpreter; `hf` may use this one (it has torch via `bench`)."""
    env_python = peer_envs_dir() / name / "bin" / "python"
    if env_python.is_file():
        return str(env_python)
    if name == "hf":
        return sys.executable
    raise PeerError(f"peer {name!r} has no environment ({env_python} is missing): "
                    f"run `bash scripts/peer-envs.sh {name}` first")


def peer_environ(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess environment: `base` (default os.environ), the repo on PYTHONPATH,
    and the peer env's peer.env entries the caller did not set."""
    env = dict(os.environ if base is None else base)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_DIR), env.get("PYTHONPATH", "")) if p)
    extra = peer_envs_dir() / name / "peer.env"
    if extra.is_file():
        for line in extra.read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key and not key.startswith("#"):
                env.setdefault(key, value)
    return env


def run_peer(name: str, prompts: Sequence[Sequence[int]], output_len: int, model: str,
             batch_size: int = 0, threads: int | None = None, stream: bool = False,
             show_progress: bool = True, temperature: float = 0.0,
             seed: int = 0, dtype: str = "float32") -> dict[str, Any]:
    """Run peer `name` on `prompts` (token ids) for exactly `output_len` tokens each,
    greedy (`temperature` 0) or sampled with prompt i seeded `seed + i` where the peer
    can (its result's `seeding` says how it did); returns its JSON result. `stream`: time
    every token (single stream). `dtype`: the peer computes in it (the engine's dtype;
    llama.cpp reads it from the GGUF it is given: bench/gguf_f32.py)."""
    script = peer_script(name)
    python = peer_python(name)
    with tempfile.TemporaryDirectory(prefix="multiserve-bench-") as tmp:
        pfile = Path(tmp) / "prompts.json"
        pfile.write_text(json.dumps({"prompts": [list(map(int, p)) for p in prompts]}))
        cmd = [python, str(script), "--prompts-file", str(pfile),
               "--output-len", str(output_len), "--model", str(model),
               "--batch-size", str(batch_size),
               "--threads", str(threads or os.cpu_count() or 1),
               "--temperature", repr(float(temperature)), "--seed", str(int(seed)),
               "--dtype", dtype]
        if stream:
            cmd.append("--stream")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                env=peer_environ(name))
        stdout = _wait(proc, f"peer {name} ({len(prompts)} x {output_len})", show_progress)
    if proc.returncode != 0:
        raise PeerError(f"peer {name} exited with code {proc.returncode}")
    lines = [ln for ln in stdout.splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise PeerError(f"peer {name} printed no JSON result")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _wait(proc: subprocess.Popen, desc: str, show_progress: bool) -> str:
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(desc=desc, bar_format="{desc}: {elapsed} elapsed", leave=False)
    try:
        while True:
            try:
                stdout, _ = proc.communicate(timeout=0.5)
                return str(stdout)
            except subprocess.TimeoutExpired:
                if bar is not None:
                    bar.refresh()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if bar is not None:
            bar.close()
