"""Runs a benchmark peer (plugins/peers/*.py) in a subprocess and reads its JSON line.

torch never enters the multiserve process: the peer script is started with the same
interpreter, gets the exact token-id prompts through a temporary JSON file, and
prints one JSON line on stdout (its last line). A progress bar shows elapsed time
while it runs; its stderr passes through.
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

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "plugins" / "peers"


class PeerError(RuntimeError):
    """The peer could not run (script missing, crashed, or printed no result)."""


def peer_script(name: str) -> Path:
    path = PLUGINS_DIR / f"{name}_generate.py"
    if not path.is_file():
        raise PeerError(f"peer script {path} not found (run from a source checkout)")
    return path


def run_peer(name: str, prompts: Sequence[Sequence[int]], output_len: int, model_dir: str,
             batch_size: int = 0, threads: int | None = None,
             show_progress: bool = True) -> dict[str, Any]:
    script = peer_script(name)
    with tempfile.TemporaryDirectory(prefix="multiserve-bench-") as tmp:
        pfile = Path(tmp) / "prompts.json"
        pfile.write_text(json.dumps({"prompts": [list(map(int, p)) for p in prompts]}))
        cmd = [sys.executable, str(script), "--prompts-file", str(pfile),
               "--output-len", str(output_len), "--model-dir", str(model_dir),
               "--batch-size", str(batch_size),
               "--threads", str(threads or os.cpu_count() or 1)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(desc=f"peer {name} ({len(prompts)} x {output_len})",
                       bar_format="{desc}: {elapsed} elapsed", leave=False)
        try:
            while True:
                try:
                    stdout, _ = proc.communicate(timeout=0.5)
                    break
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
    if proc.returncode != 0:
        raise PeerError(f"peer {name} exited with code {proc.returncode}")
    lines = [ln for ln in stdout.splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise PeerError(f"peer {name} printed no JSON result")
    result: dict[str, Any] = json.loads(lines[-1])
    return result

