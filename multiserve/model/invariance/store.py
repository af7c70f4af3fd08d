"""The calibration's on-disk cache: a plan per workload, a probe per shape.

`$MULTISERVE_CACHE_DIR/invariance/` (default ~/.cache/multiserve/invariance): one JSON file
per plan, named by the hash of its key (`backend_key`: what decides kernels: platform,
device kind, CPU model and flags, whether the native kernels build (for bfloat16 also the
instruction path of its products), jax/jaxlib, the XLA_FLAGS that can change a program
(`xla_options.compile_flags`), the programs' XLA options (xla_options.py), dtype, every
shape and size),
and under probes/ one per product, grouped or row-sum probe, named by the hash of
`probe_file_key` (the probe's shape and sizes, the software and CPU). Every file is
{"key": its key, ...}: an entry written for another key, or unreadable, is ignored
(unreadable: warned) and made again. One process makes an entry at a time (a lock file
beside it); writes are atomic (a temporary file renamed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax

from multiserve.cache_files import cache_root, exclusive
from multiserve.model.invariance.choice import Candidate
from multiserve.model.invariance.workload import Workload
from multiserve.model.invariance.xla_options import compile_flags, step_options
from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.attention_pallas import forced_kernel

log = logging.getLogger("multiserve.calibration")

PROBE_VERSION = 12  # bump when a probe or the selection changes: old cache entries are ignored


def cache_dir() -> Path:
    return cache_root() / "invariance"


def backend_key(device: Any, workload: Workload) -> dict[str, Any]:
    """What decides which kernels run: the device, the CPU, the software, the shapes."""
    import jaxlib

    key: dict[str, Any] = {
        "probe_version": PROBE_VERSION,
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", ""),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": compile_flags(device.platform, workload.dtype),
        # the options its probes and steps compile with: their machine code
        "xla_options": step_options(device.platform, workload.dtype),
        "workload": asdict(workload),
    }
    forced = forced_kernel()
    if forced is not None:  # a test's forced Pallas attention: never another run's plan
        key["attention_kernel_forced"] = forced
    if not workload.grouped:  # a dense model's key stays what it was before MoE existed
        del key["workload"]["grouped"]
    if device.platform == "cpu":
        key["cpu"] = native_kernels.cpu_facts()
        # a plan naming the native kernels is only valid where they build, as built
        key["native_kernels"] = native_kernels.build_id()
        if key["native_kernels"] is not None:  # their split and prefetch: the probes' times
            key["product_tuning"] = native_kernels.tuned().key()
        if workload.dtype == "bfloat16":  # the instruction paths its probes may choose
            key["bf16_paths"] = list(native_kernels.bf16_path_candidates())
    return key


def probe_file_key(key: tuple[Any, ...]) -> dict[str, Any]:
    """What a stored probe's result depends on: the probe's key (platform, device kind,
    dtype, the rest of its backend, shape, sizes, sharding) and the software and CPU it
    ran on."""
    import jaxlib

    return {"probe_version": PROBE_VERSION, "probe": repr(key), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "xla_flags": compile_flags(key[0], key[2]),
            "cpu": native_kernels.cpu_facts()}


def hash_key(key: dict[str, Any]) -> str:
    """A key's file name: the same in every process."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def probe_path(file_key: dict[str, Any]) -> Path:
    """The file of a stored probe."""
    return cache_dir() / "probes" / f"{hash_key(file_key)}.json"


def candidates_from_json(d: dict[str, Any]) -> list[Candidate]:
    """A stored probe's candidates."""
    return [Candidate(c["desc"], int(c["rows"]),
                      [{int(i): int(h) for i, h in run.items()} for run in c["runs"]],
                      float(c["seconds"]))
            for c in d["candidates"]]


def candidates_to_json(cands: list[Candidate]) -> dict[str, Any]:
    """A probe's candidates as stored (JSON turns the row indices into strings)."""
    return {"candidates": [{"desc": c.desc, "rows": c.rows, "runs": c.runs,
                            "seconds": c.seconds} for c in cands]}


def filled_once(path: Path, key: dict[str, Any], decode: Callable[[dict[str, Any]], Any],
                make: Callable[[], Any], encode: Callable[[Any], dict[str, Any]]) -> Any:
    """decode(the entry of `path`) if the file holds one written for `key`; else make() it
    (one process at a time: a lock file beside it; a process that waited reads the first
    one's result) and store encode(value) there."""
    value = read_entry(path, key, decode)
    if value is None:
        with exclusive(path.with_suffix(".lock")):
            value = read_entry(path, key, decode)  # made while we waited?
            if value is None:
                value = make()
                write_entry(path, key, encode(value))
    return value


def read_entry(path: Path, key: dict[str, Any], decode: Callable[[dict[str, Any]], Any]
               ) -> Any:
    """decode(the file's entry), or None: no file, another key's, or unreadable (warned)."""
    try:
        d = json.loads(path.read_text())
        return decode(d) if d.get("key") == json.loads(json.dumps(key)) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable invariance cache %s: %s", path, exc)
        return None


def write_entry(path: Path, key: dict[str, Any], body: dict[str, Any]) -> None:
    """{"key": key, **body} into `path`, atomically (a temporary file renamed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, **body}))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write the invariance cache %s: %s", path, exc)
