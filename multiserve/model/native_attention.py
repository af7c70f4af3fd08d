"""The native CPU paged attention (native/paged_attention.cc): built, loaded, called.

XLA:CPU runs the pure-JAX `attention.paged_attention` as a loop of small gathers and
batched products, which materialises every key block it reads (measured: a 64-row decode
step over ~220 keys spent ~100 ms of its ~230 ms there). The native kernel reads K/V in
place through the page table and keeps one query head's whole computation in registers.
It is row-invariant by construction (one work item per token and query head, a fixed
order of every sum; see the .cc), which the calibration still verifies bitwise like any
other candidate (model/calibration.py), and it is used only where the calibration chose
it (`AttentionPlan.kernel == "native"`): never on another platform, never for pools that
are not float32.

The shared object is compiled on first use with the system's C++ compiler (`$CXX`, else
c++ or g++; `-march=native`, so the file is specific to this CPU) and cached under
`$MULTISERVE_CACHE_DIR/kernels` (default ~/.cache/multiserve/kernels), named by a hash of
the source, the compiler, its flags, the jaxlib version (the FFI headers) and the CPU.
No compiler, or a failing build: `unavailable_reason()` says why, and the calibration
keeps the pure-JAX attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.forward_batch import ForwardBatch

log = logging.getLogger("multiserve.native_attention")

TARGET = "multiserve_paged_attention"
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)  # the head sizes the kernel is instantiated for
SOURCE = Path(__file__).parent / "native" / "paged_attention.cc"
FLAGS = ("-std=c++20", "-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-w")

_LOCK = threading.Lock()
_STATE: dict[str, str | None] = {}  # "error": None once registered, else why not


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return platform.machine()
    keep = [line for line in info.splitlines()
            if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _build(cxx: str) -> Path:
    """Compile the kernel (once per source/compiler/CPU; concurrent builders each write
    their own temporary file and rename it into place)."""
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=False).stdout
    digest = hashlib.sha256("\n".join([SOURCE.read_text(), cxx, version, " ".join(FLAGS),
                                       jaxlib.__version__, _cpu_id()]).encode()).hexdigest()
    base = os.environ.get("MULTISERVE_CACHE_DIR")
    root = (Path(base) if base else Path.home() / ".cache" / "multiserve") / "kernels"
    path = root / f"paged_attention-{digest[:20]}.so"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.so")
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    tmp.replace(path)
    return path


def unavailable_reason() -> str | None:
    """None when the kernel is built and registered with XLA:CPU in this process; else why
    it is not (the first call builds and registers it)."""
    with _LOCK:
        if "error" not in _STATE:
            _STATE["error"] = _load()
            if _STATE["error"] is not None:
                log.warning("native CPU attention unavailable (%s); using the XLA "
                            "formulation", _STATE["error"])
        return _STATE["error"]


def _load() -> str | None:
    if os.environ.get("MULTISERVE_NATIVE_ATTENTION", "1") == "0":
        return "disabled by MULTISERVE_NATIVE_ATTENTION=0"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (set $CXX or install g++)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MultiservePagedAttention),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError, ValueError) as exc:
        return f"build or load failed: {exc}"
    return None


def supports(platform_name: str, dtype: str, head_dim: int) -> bool:
    """Whether the kernel can serve an engine of this platform, pool dtype and head size
    (not whether it is built: see `unavailable_reason`)."""
    return platform_name == "cpu" and dtype == "float32" and head_dim in HEAD_DIMS


def paged_attention_native(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           layer: int | jax.Array, batch: ForwardBatch, *,
                           page_size: int) -> jax.Array:
    """q [T, H, hd] (rotated, not scaled) -> attention output [T, H, hd] in q's dtype,
    K/V read from the pools [L, KV, slots, hd] (float32) through `batch.page_table`."""
    assert k_pool.dtype == jnp.float32 and v_pool.dtype == jnp.float32, k_pool.dtype
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the plan names the native attention kernel, which is "
                           f"unavailable here: {reason}")
    head_dim = q.shape[-1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pool, v_pool, jnp.asarray(layer, jnp.int32),
               batch.positions, batch.token_seq, batch.page_table,
               page_size=np.int64(page_size), scale=np.float32(1.0 / float(head_dim) ** 0.5))
    return out.astype(q.dtype)
