"""Time the native row-invariant product in bfloat16 (each instruction path this CPU runs)
against the float32 kernel, at SmolLM2-135M's MLP shape (K=576, N=1536) by default.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \\
        python scripts/bench_bf16_product.py [--k 576] [--n 1536] [--rows 1 8 64]

Prints the CPU (/proc/cpuinfo's model name), then per row count the median time of each
kernel over --reps calls and the speed-up of each bf16 path over float32. A measurement,
not a test: run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.kernels import native


def _median_us(fn, *args, reps: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    reason = native.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"native kernels unavailable: {reason}")
    print(f"cpu: {native.cpu_facts().get('model name', '?')}; bf16 paths: "
          f"{', '.join(native.bf16_paths_available())}; K={args.k} N={args.n}")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((args.k, args.n)) / np.sqrt(args.k), jnp.float32)
    p32, p16 = native.pack_panels(w), native.pack_panels(w.astype(jnp.bfloat16))
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, args.k)), jnp.float32)
        f32 = jax.jit(lambda a, p: native.row_gemm(a, p, args.n))
        t32 = _median_us(f32, x, p32, reps=args.reps)
        line = f"rows {m:4d}: float32 {t32:8.1f} us"
        for path in native.bf16_paths_available():
            f16 = jax.jit(lambda a, p, path=path: native.row_gemm(a, p, args.n, path=path))
            t16 = _median_us(f16, x.astype(jnp.bfloat16), p16, reps=args.reps)
            line += f" | bf16 {path} {t16:8.1f} us ({t32 / t16:4.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
