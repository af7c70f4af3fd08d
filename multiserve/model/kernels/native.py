"""The native CPU kernels (src/*.cc, XLA FFI custom calls): built, loaded, called.

- paged attention (src/paged_attention.cc). XLA:CPU runs the pure-JAX
  `attention.paged_attention` as a loop of small gathers and batched products that
  materialises every key block it reads (a large share of a decode step's time:
  docs/performance.md §5); the kernel reads K/V in place through the page table and keeps
  a (token, KV head) item's whole computation in registers.
- the row-invariant matrix product (src/row_gemm.cc) against weights packed in
  64-column panels (`pack_panels`), and its grouped form (one matrix per row: a MoE layer's
  experts over the tokens routed to each, `grouped_row_gemm`): each output element is a sum
  over k in order, one FMA per step, whatever the row count. XLA:CPU's products change
  kernel with the row count (on some CPUs its 1-row product is a loop fusion whose bits
  differ from its GEMM's), so an invariant XLA plan may have to pad 1-row products to 2
  rows; this one computes every row count with the same in-order sums, 1-row products
  included (its speed against XLA's: the calibration table of `multiserve doctor`,
  docs/performance.md §3).
- the LoRA delta (src/lora_delta.cc, `lora_delta_native`): each token's low-rank product
  with its own adapter's matrices, read in place from the adapter stacks (only the slots
  the step's tokens use); `lora_apply_native`, what model/layers/lora.py calls, adds it to
  the outputs of every projection of one x in one call, in place in their (fused)
  product's output. At one token, `row_gemm_lora` (src/row_gemm_lora.cc) is the product
  and that applied delta in ONE call with the same bits: each panel's product, then the
  delta of its columns (both forms' per-element code is src/lora_math.h).

All are row-invariant by construction (see the .cc files). The attention and products,
which the calibration still verifies bitwise like any other candidate
(model/invariance/calibration.py), run only where the calibration chose them
(`Formulation.kernel == "native"`, `AttentionPlan.kernel == "native"`); the LoRA delta runs
where the plan's attention is native (model/layers/lora.py `native_lora`; its invariance is
what tests/engine/test_lora.py checks): never on another platform, never for float types
other than float32 and bfloat16, never for operands split over a tensor-parallel group.

bfloat16 forms (an engine of dtype bfloat16): `pack_panels` of a bfloat16 W packs k-pair
panels that `row_gemm` / `grouped_row_gemm` read at half the bytes (src/row_gemm_bf16.cc,
float32 accumulation, x and y float32 or bfloat16), and `paged_attention_native` reads a
bfloat16 K/V pool (widened in registers; softmax and sums float32). The bfloat16 product has
three instruction paths with different bits (`BF16_PATHS`); an engine's calibration times
the ones this CPU runs (`bf16_path_candidates`) and its plan names ONE for every bfloat16 x
bfloat16 product at every row count, so rows stay invariant (`bf16_product_path()` is the
path of a call outside a plan); a float32 x against bfloat16 panels always widens. The
candidates are part of the invariance plan's cache key.

The shared object is compiled on first use with the system's C++ compiler (`$CXX`, else
c++ or g++; `-march=native`, so the file is specific to this CPU) and cached under
`$MULTISERVE_CACHE_DIR/kernels` (default ~/.cache/multiserve/kernels), named by a hash of
the sources, the compiler, its flags, the jaxlib version (the FFI headers) and the CPU.
No compiler, or a failing build: `unavailable_reason()` says why, and the calibration
keeps XLA's formulations. MULTISERVE_NATIVE_KERNELS=0 turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
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

from multiserve.cache_files import cache_root, exclusive
from multiserve.model import lora_layout
from multiserve.model.invariance.plan import BF16_PATHS
from multiserve.model.kernels import product_tuning
from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms
from multiserve.model.layers.forward_batch import ForwardBatch

log = logging.getLogger("multiserve.native_kernels")

ATTENTION = "multiserve_paged_attention"
ATTENTION_BF16 = "multiserve_paged_attention_bf16"
ROW_GEMM = "multiserve_row_gemm"
ROW_GEMM_BF16 = "multiserve_row_gemm_bf16"
ROW_GEMM_BF16_RESIDUAL = "multiserve_row_gemm_bf16_residual"
GROUPED_ROW_GEMM = "multiserve_grouped_row_gemm"
GROUPED_ROW_GEMM_BF16 = "multiserve_grouped_row_gemm_bf16"
KV_WRITE = "multiserve_kv_write"
LORA_DELTA = "multiserve_lora_delta"
LORA_APPLY = "multiserve_lora_apply"
ROW_GEMM_LORA = "multiserve_row_gemm_lora"
LORA_MAX_RANK = 64  # the largest adapter rank lora_delta.cc takes
# The bfloat16 product's instruction paths (row_gemm_bf16.cc), in the kernel's numbering:
# "avx512_bf16" one VDPBF16PS per pair of k (bfloat16 x only, a CPU with AVX512_BF16);
# "widen" bfloat16 -> float32 in registers, one FMA per k in order (any CPU; its bits are
# the float32 kernel's on the widened operands); "amx" AMX-BF16 tiles (bfloat16 x only, a
# CPU and kernel that grant them; src/amx_panel.h states its sums).
# (BF16_PATHS: defined beside the plan's Formulation, which names one)
# a BF16_PATHS name: the only path this process's calibration may choose, and the default
BF16_PATH_ENV = "MULTISERVE_BF16_PATH"
DTYPES = ("float32", "bfloat16")  # the operand types the kernels take
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)  # the head sizes the kernel is instantiated for
PANEL = 64  # columns per packed weight panel (row_gemm.cc)
SOURCES = tuple(Path(__file__).parent / "src" / name
                for name in ("paged_attention.cc", "row_gemm.cc", "row_gemm_bf16.cc",
                             "kv_write.cc", "lora_delta.cc", "row_gemm_lora.cc"))
HEADERS = tuple(Path(__file__).parent / "src" / name  # hashed, not compiled
                for name in ("amx_panel.h", "float_ops.h", "parallel_for.h", "product_split.h",
                             "lanes16.h", "lora_math.h",
                             "lora_operands.h", "row_panel.h"))
FLAGS = ("-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-w")

_LOCK = threading.Lock()
_LIB: list[ctypes.CDLL] = []  # the loaded kernels (once registered)
# "error": None once registered, else why not; "so": the file; "bf16_paths": the BF16_PATHS
# this CPU and build run, comma-separated; "bf16_forced": MULTISERVE_BF16_PATH's path or
# None (fixed at load)
_STATE: dict[str, str | None] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_facts() -> dict[str, str]:
    """What identifies this CPU for compiled code and measured plans: the machine and
    /proc/cpuinfo's model name, flags (x86) or Features / CPU part (Arm) of its first core.
    Part of the kernels' build hash and of the invariance plan's cache key."""
    facts = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return facts
    for line in info.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags", "Features", "CPU part") and name not in facts:
            facts[name] = value.strip()
    return facts


def _build(cxx: str) -> Path:
    """Compile the kernel (once per source/compiler/CPU; concurrent builders each write
    their own temporary file and rename it into place)."""
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=False).stdout
    inputs = [*(src.read_text() for src in SOURCES + HEADERS), cxx, version, " ".join(FLAGS),
              jaxlib.__version__, json.dumps(cpu_facts(), sort_keys=True)]
    digest = hashlib.sha256("\n".join(inputs).encode()).hexdigest()
    root = cache_root() / "kernels"
    path = root / f"multiserve-kernels-{digest[:20]}.so"
    if path.exists():
        return path
    with exclusive(root / ".build.lock"):  # one build; the others wait for it
        if path.exists():
            return path
        return _compile_to(cxx, path)


def _compile_to(cxx: str, path: Path) -> Path:
    """Each source compiled to an object by its own compiler process (at once: they are
    independent, and each -O3 compile is slow, docs/performance.md §9), then linked into
    `path`."""
    tmp = path.with_suffix(f".tmp{os.getpid()}.so")
    objects = [path.with_suffix(f".tmp{os.getpid()}.{src.stem}.o") for src in SOURCES]
    compile_flags = [f for f in FLAGS if f != "-shared"]
    cmds = [[cxx, *compile_flags, "-I", jax.ffi.include_dir(), "-c", str(src), "-o", str(obj)]
            for src, obj in zip(SOURCES, objects, strict=True)]
    try:
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for cmd in cmds]
        for cmd, proc in zip(cmds, procs, strict=True):
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-2000:]}")
        link = [cxx, *FLAGS, *map(str, objects), "-o", str(tmp)]
        done = subprocess.run(link, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed: {done.stderr.strip()[-2000:]}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        for obj in objects:
            obj.unlink(missing_ok=True)
    return path


def unavailable_reason(dtype: str = "float32") -> str | None:
    """None when the kernels for operands of `dtype` (a DTYPES name) are built and
    registered with XLA:CPU in this process; else why they are not (the first call builds
    and registers them)."""
    if dtype not in DTYPES:
        return f"no native kernels for {dtype} (only {', '.join(DTYPES)})"
    with _LOCK:
        if "error" not in _STATE:
            _STATE["error"] = _load()
            if _STATE["error"] is not None:
                log.warning("native CPU kernels unavailable (%s); using XLA's "
                            "formulations", _STATE["error"])
        error = _STATE["error"]
    if error is None:  # the machine's split and prefetch, set once (outside the lock:
        tuned()        # its measurement runs products)
    return error


def tuned() -> product_tuning.ProductTuning:
    """The products' split and prefetch on this machine (product_tuning.py), set in the
    loaded kernels once per process; the kernels must be loaded."""
    lib = _LIB[0]
    cache_file = cache_root() / "kernels" / f"{_STATE['so']}.tuning.json"
    return product_tuning.ensure(lib, cache_file,
                                 lambda: product_tuning.measure(lib, pack_panels, row_gemm))


def _load() -> str | None:
    if os.environ.get("MULTISERVE_NATIVE_KERNELS", "1") == "0":
        return "disabled by MULTISERVE_NATIVE_KERNELS=0"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (set $CXX or install g++)"
    try:
        path = _build(cxx)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(ATTENTION,
                                    jax.ffi.pycapsule(lib.MultiservePagedAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ROW_GEMM, jax.ffi.pycapsule(lib.MultiserveRowGemm),
                                    platform="cpu")
        jax.ffi.register_ffi_target(GROUPED_ROW_GEMM,
                                    jax.ffi.pycapsule(lib.MultiserveGroupedRowGemm),
                                    platform="cpu")
        for name, symbol in ((ATTENTION_BF16, lib.MultiservePagedAttentionBf16),
                             (ROW_GEMM_BF16, lib.MultiserveRowGemmBf16),
                             (ROW_GEMM_BF16_RESIDUAL, lib.MultiserveRowGemmBf16Residual),
                             (GROUPED_ROW_GEMM_BF16, lib.MultiserveGroupedRowGemmBf16),
                             (KV_WRITE, lib.MultiserveKvWrite),
                             (LORA_DELTA, lib.MultiserveLoraDelta),
                             (LORA_APPLY, lib.MultiserveLoraApply),
                             (ROW_GEMM_LORA, lib.MultiserveRowGemmLora)):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        runs = {"avx512_bf16": bool(lib.MultiserveBf16DotAvailable()), "widen": True,
                "amx": bool(lib.MultiserveBf16AmxAvailable())}
    except (OSError, RuntimeError, AttributeError, ValueError) as exc:
        return f"build or load failed: {exc}"
    _STATE["so"] = path.name
    _LIB.append(lib)
    _STATE["bf16_paths"] = ",".join(p for p in BF16_PATHS if runs[p])
    forced = os.environ.get(BF16_PATH_ENV, "") or None
    if forced is not None and not runs.get(forced, False):
        log.warning("%s=%s: not a bfloat16 product path this CPU and build run (%s); "
                    "ignored", BF16_PATH_ENV, forced, _STATE["bf16_paths"])
        forced = None
    _STATE["bf16_forced"] = forced
    return None


def bf16_paths_available() -> tuple[str, ...]:
    """The bfloat16 product paths this CPU and build run (none when unavailable)."""
    if unavailable_reason() is not None:
        return ()
    return tuple((_STATE.get("bf16_paths") or "").split(","))


def bf16_path_candidates() -> tuple[str, ...]:
    """The paths a calibration may choose among for a bfloat16 x bfloat16 product: the one
    MULTISERVE_BF16_PATH forces (read once, when the kernels load), else every available
    one. The calibration times each and keeps ONE for every product of its plan at every
    row count (model/invariance/calibration.py)."""
    forced = _STATE.get("bf16_forced") if unavailable_reason() is None else None
    return (forced,) if forced else bf16_paths_available()


def bf16_product_path() -> str | None:
    """The path of a bfloat16 x bfloat16 product called without one (outside a plan:
    scripts, tests, reference loops): MULTISERVE_BF16_PATH's, else "avx512_bf16" where this
    CPU and build run it, else "widen"; None when the kernels are unavailable. An engine's
    products run its plan's path instead (`Formulation.path`)."""
    candidates = bf16_path_candidates()
    if not candidates:
        return None
    return candidates[0] if len(candidates) == 1 else next(
        p for p in ("avx512_bf16", "widen") if p in candidates)


def build_id() -> str | None:
    """The loaded kernels' file name (a hash of sources, compiler, flags, jaxlib, CPU), or
    None when they are unavailable: part of the invariance plan's cache key."""
    return _STATE.get("so") if unavailable_reason() is None else None


def supports_attention(platform_name: str, dtype: str, head_dim: int) -> bool:
    """Whether the attention kernel can serve an engine of this platform, pool dtype and
    head size (not whether it is built: see `unavailable_reason`)."""
    return platform_name == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def supports_products(platform_name: str, dtype: str) -> bool:
    """Whether the product kernel can serve an engine of this platform and weight dtype
    (float32 or bfloat16 weights; the activations are the same dtype)."""
    return platform_name == "cpu" and dtype in DTYPES


def _require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the invariance plan names a native kernel, which is "
                           f"unavailable here: {reason}")


def pack_panels(w: jax.Array) -> jax.Array:
    """W [..., K, N] -> the panels `row_gemm` reads (columns past N are zeros):
    - float32: [..., ceil(N / 64), K, 64], panel p = columns 64p..64p+63, row k contiguous;
    - bfloat16: k-pair panels [..., ceil(N / 64), ceil(K / 2), 128], element (p, j, 2c + e)
      = W[2j + e, 64p + c] (an odd K's last pair padded with a zero row): row_gemm_bf16.cc.
    Packing moves values and never rounds: the bits of W are kept."""
    k, n = w.shape[-2:]
    pad = -n % PANEL
    lead = w.shape[:-2]
    if w.dtype == jnp.bfloat16:
        w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, k % 2), (0, pad)])
        pairs = (k + 1) // 2
        w = w.reshape(*lead, pairs, 2, (n + pad) // PANEL, PANEL)  # [.., j, e, p, c]
        w = jnp.moveaxis(w, -2, -4)  # [.., p, j, e, c]
        return jnp.swapaxes(w, -1, -2).reshape(*lead, (n + pad) // PANEL, pairs, 2 * PANEL)
    if pad:
        w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
    w = w.reshape(*lead, k, (n + pad) // PANEL, PANEL)
    return jnp.moveaxis(w, -2, -3)


def unpack_panels(panels: jax.Array, k: int, n: int) -> jax.Array:
    """The exact inverse of `pack_panels`: panels (float32 [..., P, K, 64] or bfloat16
    k-pair panels [..., P, ceil(K / 2), 128]) -> W [..., K, N], the padding (columns past
    N, an odd K's zero row) dropped. Moves values and never rounds: the bits of W come
    back."""
    lead = panels.shape[:-3]
    count = panels.shape[-3]
    assert count == -(-n // PANEL), (panels.shape, n)
    if panels.dtype == jnp.bfloat16:
        pairs = panels.shape[-2]
        assert pairs == (k + 1) // 2 and panels.shape[-1] == 2 * PANEL, (panels.shape, k)
        w = panels.reshape(*lead, count, pairs, PANEL, 2)  # [.., p, j, c, e]
        w = jnp.swapaxes(w, -1, -2)  # [.., p, j, e, c]
        w = jnp.moveaxis(w, -4, -2)  # [.., j, e, p, c]
        return w.reshape(*lead, 2 * pairs, count * PANEL)[..., :k, :n]
    assert panels.shape[-2:] == (k, PANEL), (panels.shape, k)
    w = jnp.moveaxis(panels, -3, -2)  # [.., K, p, c]
    return w.reshape(*lead, k, count * PANEL)[..., :n]


def _bf16_product(target: str, x: jax.Array, panels: jax.Array, index: jax.Array,
                  n: int, out_dtype: jnp.dtype | None, path: str | None,
                  residual: jax.Array | None = None) -> jax.Array:
    """The bfloat16-panel product `target` (dense: index = the layer; grouped: the groups);
    with `residual` ([M, n] bfloat16; dense only) the kernel's epilogue adds it."""
    assert x.dtype in (jnp.float32, jnp.bfloat16), x.dtype
    assert panels.ndim == 4 and panels.shape[2] == (x.shape[1] + 1) // 2, (x.shape,
                                                                           panels.shape)
    _require()
    # no bfloat16 instruction takes float32 operands
    path_index = _bf16_path_index("widen" if x.dtype == jnp.float32 else path)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    assert out_dtype in (jnp.float32, jnp.bfloat16), out_dtype
    m, width = x.shape[0], panels.shape[1] * PANEL
    operands: tuple[jax.Array, ...] = (x, panels, index)
    if residual is not None:
        assert out_dtype == jnp.bfloat16 and residual.dtype == jnp.bfloat16, residual.dtype
        assert residual.shape == (m, n), (residual.shape, m, n)
        operands = (*operands, _padded_to(residual, width))
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, width), out_dtype))(
        *operands, path=np.int64(path_index))
    return out if out.shape[1] == n else out[:, :n]


def _bf16_path_index(path: str | None) -> int:
    """The kernel's number of bfloat16 product path `path` (None: this process's,
    `bf16_product_path`); a path this build and CPU do not run raises."""
    path = path or bf16_product_path()
    if path not in bf16_paths_available():
        raise RuntimeError(f"bfloat16 product path {path!r} does not run here (available: "
                           f"{', '.join(bf16_paths_available())})")
    return BF16_PATHS.index(path)


def _padded_to(residual: jax.Array, width: int) -> jax.Array:
    """A residual [M, n] widened with zero columns to the product's padded width (the
    padding columns' sums are dropped after the call: any addend will do)."""
    n = residual.shape[1]
    return residual if width == n else jnp.pad(residual, ((0, 0), (0, width - n)))


def row_gemm(x: jax.Array, panels: jax.Array, n: int,
             layer: int | jax.Array | None = None, *, out_dtype: jnp.dtype | None = None,
             path: str | None = None, residual: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ W -> [M, n], W given as `pack_panels(W)` [P, K, 64] or, with `layer` (an
    int or traced scalar), as a stack of layers [L, P, K, 64] read in place: every element
    summed over k in one fixed order, so each row's bits are independent of M.
    float32 panels: x float32, y float32. bfloat16 panels ([.., P, ceil(K / 2), 128]): x
    float32 or bfloat16, y `out_dtype` (default x's; float32 or bfloat16, rounded once from
    the float32 sum), `path` a BF16_PATHS name (default `bf16_product_path()`; a float32 x
    always widens). `residual` (bfloat16 panels and y only: [M, n] bfloat16): y is
    `residual + x @ W` with the bits of that bfloat16 add done apart (one rounding of the
    product, one of the float32 sum), the add in the kernel's epilogue."""
    if layer is None:
        assert panels.ndim == 3, panels.shape
        panels, layer = panels[None], 0
    if panels.dtype == jnp.bfloat16:
        return _bf16_product(ROW_GEMM_BF16 if residual is None else ROW_GEMM_BF16_RESIDUAL,
                             x, panels, jnp.asarray(layer, jnp.int32), n, out_dtype, path,
                             residual)
    assert residual is None, "the float32 product takes no residual"
    assert x.dtype == jnp.float32 and panels.dtype == jnp.float32, (x.dtype, panels.dtype)
    _require()
    m = x.shape[0]
    out = jax.ffi.ffi_call(ROW_GEMM, jax.ShapeDtypeStruct((m, panels.shape[1] * PANEL),
                                                          jnp.float32))(
        x, panels, jnp.asarray(layer, jnp.int32))
    return out if out.shape[1] == n else out[:, :n]


def grouped_row_gemm(x: jax.Array, panels: jax.Array, groups: jax.Array, n: int, *,
                     out_dtype: jnp.dtype | None = None, path: str | None = None
                     ) -> jax.Array:
    """y[m] = x[m] @ W[groups[m]] -> [M, n]: x [M, K] (rows best sorted by group), W given
    as panels [G, P, K, 64] (`pack_panels` of a [G, K, N] stack), groups [M] int32 in
    [0, G). Each row's bits depend only on its x row and its group's W (row_gemm.cc).
    bfloat16 panels: dtypes and `path` as in `row_gemm`."""
    if panels.dtype == jnp.bfloat16:
        return _bf16_product(GROUPED_ROW_GEMM_BF16, x, panels, groups.astype(jnp.int32), n,
                             out_dtype, path)
    assert x.dtype == jnp.float32 and panels.dtype == jnp.float32, (x.dtype, panels.dtype)
    _require()
    m = x.shape[0]
    out = jax.ffi.ffi_call(GROUPED_ROW_GEMM, jax.ShapeDtypeStruct(
        (m, panels.shape[1] * PANEL), jnp.float32))(x, panels, groups.astype(jnp.int32))
    return out if out.shape[1] == n else out[:, :n]


def kv_write_native(pool: jax.Array, rows: jax.Array, layer: int | jax.Array,
                    slots: jax.Array) -> jax.Array:
    """`pool` [L, KV, S, HD] with `rows` [T, KV, HD] written at layer `layer`, slot
    `slots[t]` (kv_write.cc): in place (the pool operand is aliased to the result), bits
    copied. For pools XLA:CPU cannot scatter into in place (bfloat16: its float
    normalization converts the whole pool to float32 and back on every write)."""
    _require()
    call = jax.ffi.ffi_call(KV_WRITE, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})
    return call(pool, rows.astype(pool.dtype), jnp.asarray(layer, jnp.int32).reshape(1),
                slots.astype(jnp.int32))


def lora_delta_native(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
                      slots: jax.Array, layer: int | jax.Array) -> jax.Array:
    """float32 [T, N]: token t's (x[t] @ A[layer, s]) @ B[layer, s] * scale[s], s =
    slots[t] (zeros where s is 0), for the LoRA stacks a [L, S, K, r] and b [L, S, r, N]
    read in place (src/lora_delta.cc: float32 sums in an order fixed by K and r, row-invariant by
    construction). x, a and b all float32 or all bfloat16; r <= LORA_MAX_RANK."""
    assert x.dtype == a.dtype == b.dtype and x.dtype in (jnp.float32, jnp.bfloat16), (
        x.dtype, a.dtype, b.dtype)
    assert a.shape[-1] <= LORA_MAX_RANK, a.shape
    _require()
    call = jax.ffi.ffi_call(LORA_DELTA, jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]),
                                                             jnp.float32))
    return call(x, a, b, scale.astype(jnp.float32), slots.astype(jnp.int32),
                jnp.asarray(layer, jnp.int32).reshape(1))


def lora_apply_native(x: jax.Array, y: jax.Array, a: tuple[jax.Array, ...],
                      b: tuple[jax.Array, ...], offsets: tuple[int, ...], scale: jax.Array,
                      slots: jax.Array, layer: int | jax.Array) -> jax.Array:
    """y [T, W] with the LoRA delta of each projection m (`lora_delta_native` of a[m],
    b[m]) added to its columns [offsets[m], offsets[m] + N_m): for a token with an adapter
    y + d in float32, rounded once to y's dtype; a token of slot 0, and every column no
    projection covers, keep y's bits. One call for every projection of the same x, y
    whole (a fused product's output: src/lora_delta.cc, the applied form, y aliased to
    the result); x, y, a and b all float32 or all bfloat16."""
    assert len(a) == len(b) == len(offsets) and a
    assert all(v.dtype == x.dtype for v in (y, *a, *b)), [v.dtype for v in (y, *a, *b)]
    assert x.dtype in (jnp.float32, jnp.bfloat16) and max(m.shape[-1] for m in a) <= \
        LORA_MAX_RANK
    assert all(0 <= o and o + bm.shape[-1] <= y.shape[1] for o, bm in zip(offsets, b,
                                                                            strict=True))
    _require()
    operands: list[jax.Array] = [x, slots.astype(jnp.int32), scale.astype(jnp.float32),
                                 jnp.asarray(layer, jnp.int32).reshape(1), y]
    for am, bm in zip(a, b, strict=True):
        operands += [am, bm]
    call = jax.ffi.ffi_call(LORA_APPLY, jax.ShapeDtypeStruct(y.shape, y.dtype),
                            input_output_aliases={4: 0})
    return call(*operands, offsets=np.asarray(offsets, np.int64))


def row_gemm_lora(x: jax.Array, panels: jax.Array, n: int, layer: int | jax.Array,
                  a: tuple[jax.Array, ...], b: tuple[jax.Array, ...],
                  offsets: tuple[int, ...], scale: jax.Array, slots: jax.Array, *,
                  residual: jax.Array | None = None, path: str | None = None,
                  b_panels: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """One row: `row_gemm(x, panels, n, layer, residual=residual)` followed by
    `lora_apply_native(x, that, a, b, offsets, scale, slots, layer)`, in ONE call with the
    same bits (src/row_gemm_lora.cc: each panel's product, then the delta of its
    columns): x [1, K], panels the layer stack (float32, or bfloat16 with x bfloat16),
    a, b, y and `residual` ([1, n]: the result is residual + x @ W before the deltas) of
    x's dtype; `path` as in `row_gemm` (bfloat16); `offsets` multiples of 64 in order
    (members from panel boundaries, as the fused products' columns). The kernel reads B
    panel by panel: `b_panels` (model/lora_layout.py `b_panels` of each b: the runner's
    `<m>_bp` buffers); None: made from `b` here (a copy in the program). -> [1, n]."""
    assert x.ndim == 2 and x.shape[0] == 1 and panels.ndim == 4, (x.shape, panels.shape)
    assert len(a) == len(b) == len(offsets) and a
    assert all(v.dtype == x.dtype for v in (panels, *a, *b)), [v.dtype for v in (panels, *a)]
    assert x.dtype in (jnp.float32, jnp.bfloat16) and max(m.shape[-1] for m in a) <= \
        LORA_MAX_RANK
    assert all(0 <= o and o % PANEL == 0 and o + bm.shape[-1] <= n
               for o, bm in zip(offsets, b, strict=True))
    if b_panels is None:
        b_panels = tuple(lora_layout.b_panels(bm, jnp) for bm in b)
    assert all(bp.shape == (*bm.shape[:2], -(-bm.shape[-1] // PANEL), bm.shape[2], PANEL)
               and bp.dtype == bm.dtype for bp, bm in zip(b_panels, b, strict=True))
    _require()
    width = panels.shape[1] * PANEL
    operands: list[jax.Array] = [x, panels, jnp.asarray(layer, jnp.int32).reshape(1),
                                 slots.astype(jnp.int32).reshape(1),
                                 scale.astype(jnp.float32)]
    if residual is not None:
        assert residual.dtype == x.dtype and residual.shape == (1, n), residual.shape
        operands.append(_padded_to(residual, width))
    for am, bp in zip(a, b_panels, strict=True):
        operands += [am, bp]
    path_index = _bf16_path_index(path) if x.dtype == jnp.bfloat16 else 1  # f32: unused
    out = jax.ffi.ffi_call(ROW_GEMM_LORA, jax.ShapeDtypeStruct((1, width), x.dtype))(
        *operands, offsets=np.asarray(offsets, np.int64),
        widths=np.asarray([bm.shape[-1] for bm in b], np.int64), path=np.int64(path_index),
        residual=np.int64(residual is not None))
    return out if width == n else out[:, :n]


def paged_attention_native(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           layer: int | jax.Array, batch: ForwardBatch, *,
                           page_size: int, terms: AttentionTerms = PLAIN_ATTENTION
                           ) -> jax.Array:
    """q [T, H, hd] (rotated, not scaled) -> attention output [T, H, hd] in q's dtype,
    K/V read from the pools [L, KV, slots, hd] (both float32 or both bfloat16) through
    `batch.page_table`; q, the softmax and every sum in float32 (paged_attention.cc).
    `terms`: the layer's scale, sliding window, sinks and soft cap (attention_terms.py)."""
    assert k_pool.dtype == v_pool.dtype and k_pool.dtype in (jnp.float32, jnp.bfloat16), (
        k_pool.dtype, v_pool.dtype)
    _require()
    target = ATTENTION if k_pool.dtype == jnp.float32 else ATTENTION_BF16
    return paged_attention_call(target, q, k_pool, v_pool, layer, batch,
                                page_size=page_size, terms=terms).astype(q.dtype)


def paged_attention_call(target: str, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                         layer: int | jax.Array, batch: ForwardBatch, *,
                         page_size: int, terms: AttentionTerms = PLAIN_ATTENTION
                         ) -> jax.Array:
    """The FFI call of paged_attention.cc registered as `target` (its operands and
    attributes; the scale `terms.scale_for(head_dim)`, the window as a [1] operand, 0 for
    none; the sinks [H] float32, zeros unread without them): float32 output [T, H, hd].
    scripts/ab_attention.py calls other builds of the kernel through it."""
    heads = q.shape[1]
    sinks = (jnp.zeros(heads, jnp.float32) if terms.sinks is None
             else terms.sinks.astype(jnp.float32))
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_pool, v_pool, jnp.asarray(layer, jnp.int32),
                batch.positions, batch.token_seq, batch.page_table,
                jnp.asarray(terms.window, jnp.int32).reshape(1), sinks,
                page_size=np.int64(page_size),
                scale=np.float32(terms.scale_for(q.shape[-1])),
                has_sinks=np.int64(terms.sinks is not None),
                softcap=np.float32(terms.softcap))
