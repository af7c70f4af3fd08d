"""Two versions of the native paged attention kernel (paged_attention.cc) timed against each
other in ONE process, calls interleaved: on a shared VM whose speed moves by 10-20% between
runs minutes apart, only an interleaved comparison shows a change of a few percent.

    git show HEAD:multiserve/model/kernels/src/paged_attention.cc > /tmp/before.cc
    python scripts/ab_attention.py /tmp/before.cc multiserve/model/kernels/src/paged_attention.cc

Each source is compiled with the engine's flags (native.FLAGS) into its own shared object,
its FFI symbols renamed so both register with XLA:CPU; the cases are bench_attention.py's
(bfloat16 or float32 pools, `--dtype`). Per case: each side's median and best per call
over `--rounds` rounds (the order alternating each round), the median of the per-round
ratios B/A, and whether the two outputs are bitwise equal.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import CASES, PAGE, problems  # noqa: E402

from multiserve.model.kernels import native  # noqa: E402

SYMBOLS = {"float32": "MultiservePagedAttention", "bfloat16": "MultiservePagedAttentionBf16"}


def _register(source: Path, tag: str, dtype: str, build: Path) -> str:
    """Compile `source` with its attention symbol for `dtype` renamed; the FFI target name."""
    symbol = SYMBOLS[dtype]
    code = source.read_text()
    other = SYMBOLS["bfloat16" if dtype == "float32" else "float32"]
    code = (code.replace(f"{symbol},", f"AbAttention{tag},")
            .replace(f"{other},", f"AbUnused{tag},"))
    cc, so = build / f"{tag}.cc", build / f"{tag}.so"
    cc.write_text(code)
    cxx = native._compiler()
    assert cxx is not None, "no C++ compiler"
    subprocess.run([cxx, *native.FLAGS, "-I", jax.ffi.include_dir(), "-I",
                    str(native.SOURCES[0].parent), str(cc), "-o", str(so)], check=True)
    lib = ctypes.cdll.LoadLibrary(str(so))
    target = f"ab_attention_{tag}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, f"AbAttention{tag}")),
                                platform="cpu")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--dtype", choices=tuple(SYMBOLS), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--cases", nargs="*", default=[c for c in CASES if c != "decode1"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        targets = [_register(src, tag, args.dtype, Path(tmp))
                   for src, tag in ((args.a, "A"), (args.b, "B"))]
    dtype = jnp.dtype(args.dtype)
    for pb in problems(tuple(args.cases)):
        kp, vp = jnp.asarray(pb.k, dtype), jnp.asarray(pb.v, dtype)
        layers = range(pb.layers) if pb.layers > 2 else (1,)
        fns = [jax.jit(lambda q, k, v, b, target=target: jnp.stack(
            [native.paged_attention_call(target, q, k, v, layer, b, page_size=PAGE)
             for layer in layers])) for target in targets]
        outs = [np.asarray(fn(pb.q, kp, vp, pb.batch)) for fn in fns]
        times: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                for _ in range(pb.calls):
                    done = fns[side](pb.q, kp, vp, pb.batch)
                done.block_until_ready()
                times[side].append((time.perf_counter() - t0) / pb.calls * 1e6)
        a, b = np.array(times[0]), np.array(times[1])
        same = np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
        key = f"{pb.name}_{dtype.name}"
        print(f"{key:28s} A {np.median(a):9.1f} us (best {a.min():.1f})  "
              f"B {np.median(b):9.1f} us (best {b.min():.1f})  B/A {np.median(b / a):.3f}  "
              f"{'bitwise' if same else 'bits differ'}", flush=True)


if __name__ == "__main__":
    main()
