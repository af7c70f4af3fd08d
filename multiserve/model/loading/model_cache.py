"""The on-disk conversion cache: a GGUF file converted once to an HF-format directory
(config.json, generation_config.json, model.safetensors in float32, tokenizer files, and a
`multiserve_source.json` marker recording the GGUF's path, size and mtime).

Location: `$MULTISERVE_CACHE_DIR` if set, else `~/.cache/multiserve/models`; one
subdirectory per converted file. Clearing it is always safe (`rm -rf` that folder): the next
load converts again.

Invariants: a cache directory is complete whenever it exists under its final name (it is
written under a temporary name in the same folder and renamed atomically), so concurrent
processes never see a half-written cache; a marker mismatch (the GGUF changed) rebuilds it.
One converter at a time per cache directory (cache_files.exclusive): a fleet's engines
(threads) and concurrent processes that find no valid cache wait, and all but the first
then read the first one's result: a fleet pays for one conversion, not for several racing
for the same cores and memory (docs/performance.md §6).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from multiserve.cache_files import cache_root as _common_root
from multiserve.cache_files import exclusive
from multiserve.model.errors import ModelLoadError

MARKER = "multiserve_source.json"
FORMAT_VERSION = 1


def cache_root() -> Path:
    # converted models sit in $MULTISERVE_CACHE_DIR itself (as they always have), else in
    # the common root's models/ folder
    return _common_root() if os.environ.get("MULTISERVE_CACHE_DIR") else _common_root() / "models"


def _source_record(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {"source": str(gguf_path.resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "format_version": FORMAT_VERSION}


def _is_valid(out_dir: Path, record: dict) -> bool:
    try:
        return json.loads((out_dir / MARKER).read_text()) == record
    except (OSError, json.JSONDecodeError):
        return False


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF-format directory for `gguf_path` into `out_dir` (not atomic)."""
    from multiserve.model.loading.gguf import read_gguf
    from multiserve.model.loading.gguf_tokenizer import write_tokenizer_files
    from multiserve.model.loading.hf import config_to_hf
    from multiserve.model.loading.hf_names import params_from_hf
    from multiserve.model.loading.safetensors_io import save_file

    cfg, named, meta = read_gguf(gguf_path)
    params_from_hf(named, cfg, source=str(gguf_path))  # validates names and shapes
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out_dir, cfg.architecture, meta, gguf_path,
                          cfg.max_position_embeddings)
    save_file({k: v.astype(np.float32) for k, v in named.items()},
              out_dir / "model.safetensors")
    hf_cfg = config_to_hf(cfg)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def cached_gguf_dir(gguf_path: Path | str, name: str | None = None) -> Path:
    """The cache directory holding `gguf_path` converted to HF format (converting if needed).

    `name` names the subdirectory (default: the file's stem + a hash of its path).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: GGUF file not found")
    record = _source_record(gguf_path)
    if name is None:
        digest = hashlib.sha256(record["source"].encode()).hexdigest()[:12]
        name = f"{gguf_path.stem}-{digest}"
    root = cache_root()
    target = root / name
    if _is_valid(target, record):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / f".{name}.lock"):
        if _is_valid(target, record):  # converted while we waited
            return target
        return _convert_into(gguf_path, target, record)


def _convert_into(gguf_path: Path, target: Path, record: dict) -> Path:
    root, name = target.parent, target.name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is a normal folder
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / MARKER).write_text(json.dumps(record))
        if target.exists():
            if _is_valid(target, record):  # another process finished first
                return target
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{name}-", dir=root))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if _is_valid(target, record):  # lost a race to a concurrent converter
                return target
            raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
