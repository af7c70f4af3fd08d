"""A decode step's products at one row on SmolLM2-135M's shapes (30 layers: wqkv 576x960,
wo 576x576, gate|up 576x3072, down 1536x576; the tied head 576x49152), bfloat16, per path:
seconds per step and the weight read rate. Settings by MULTISERVE_PRODUCT_TUNING (else the
machine's measured tuning), ROWS (default 1), REPS (default 20, best of).

    .venv/bin/python scripts/decode_products.py
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.kernels import native

assert native.unavailable_reason("bfloat16") is None
print("tuning", native.tuned().key(), native.tuned().source, "paths", native.bf16_paths_available())
rng = np.random.default_rng(0)
L = 30
shapes = {"wqkv": (576, 960), "wo": (576, 576), "gateup": (576, 3072), "down": (1536, 576)}
stacks = {
    n: native.pack_panels(jnp.asarray(rng.standard_normal((L, k, m)) / np.sqrt(k), jnp.bfloat16))
    for n, (k, m) in shapes.items()
}
head = native.pack_panels(jnp.asarray(rng.standard_normal((576, 49152)) / 24, jnp.bfloat16))
nbytes = sum(int(s.size) * 2 for s in stacks.values()) + int(head.size) * 2
rows = int(os.environ.get("ROWS", 1))


def step(path):
    @jax.jit
    def run(x, stacks, head):
        def body(i, h):
            q = native.row_gemm(h, stacks["wqkv"], 960, i, path=path)
            o = native.row_gemm(q[:, :576], stacks["wo"], 576, i, path=path)
            g = native.row_gemm(o, stacks["gateup"], 3072, i, path=path)
            d = native.row_gemm(g[:, :1536], stacks["down"], 576, i, path=path)
            return d

        h = jax.lax.fori_loop(0, L, body, x)
        return native.row_gemm(h, head, 49152, path=path)[:, :8]

    return run


x = jnp.asarray(rng.standard_normal((rows, 576)) * 0.1, jnp.bfloat16)
for path in native.bf16_paths_available():
    f = step(path)
    jax.block_until_ready(f(x, stacks, head))
    best = 1e9
    for _ in range(int(os.environ.get("REPS", 20))):
        t = time.perf_counter()
        jax.block_until_ready(f(x, stacks, head))
        best = min(best, time.perf_counter() - t)
    print(
        f"{path:12s} rows {rows}: {best * 1e3:7.2f} ms per step, "
        f"{nbytes / best / 1e9:6.1f} GB/s of weights ({nbytes / 1e6:.0f} MB)"
    )
