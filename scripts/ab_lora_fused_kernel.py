"""The one-token LoRA kernels alone: 30 layers x the four products of SmolLM2-135M's shapes
(q|k|v, o with its residual, gate|up, down with its residual), random weights and rank-16
adapters of 4 slots, one row, each product's output fed to the next; in one process,
forms alternating in order, rounds of 10 programs each:

    PYTHONPATH=. python scripts/ab_lora_fused_kernel.py [--dtype bfloat16] [--rounds 12] [--apart]

- base:     `row_gemm` alone (slot 0: no LoRA work anywhere);
- separate: `row_gemm`, then `lora_apply_native` (slot 1), as at T > 1;
- fused0:   `row_gemm_lora` with slot 0 (the fused call's own cost, no delta);
- fused:    `row_gemm_lora` with slot 1 (model/kernels/src/row_gemm_lora.cc).
Checks the bits first (fused = separate, fused0 = base), then prints each form's median
and best ms a program and the medians of the per-round differences. Where the kernels
have no `row_gemm_lora` (an older tree) only base and separate run.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model import lora_layout
from multiserve.model.kernels import native

LAYERS, SLOTS, RANK = 30, 5, 16
HIDDEN, KV, INTER = 576, 192, 1536
# name -> (K, N) of each projection
PROJECTIONS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV),
               "o": (HIDDEN, HIDDEN), "g": (HIDDEN, INTER), "u": (HIDDEN, INTER),
               "d": (INTER, HIDDEN)}
# product -> (its projections, their first columns, its width N, whether it adds a residual)
PRODUCTS = {"qkv": (("q", "k", "v"), (0, HIDDEN, HIDDEN + KV), HIDDEN + 2 * KV, False),
            "o": (("o",), (0,), HIDDEN, True),
            "gu": (("g", "u"), (0, INTER), 2 * INTER, False),
            "d": (("d",), (0,), HIDDEN, True)}
# --apart: q, k and v as three products (where the plan's one-token rows differ between
# them, `llama.fused_groups` does not fuse q|k|v)
APART = {"q": (("q",), (0,), HIDDEN, False), "k": (("k",), (0,), KV, False),
         "v": (("v",), (0,), KV, False),
         **{k: v for k, v in PRODUCTS.items() if k != "qkv"}}
FORMS = {"base": ("product", 0), "separate": ("separate", 1), "fused0": ("fused", 0),
         "fused": ("fused", 1)}


def step(x: jax.Array, slots: jax.Array, form: str, w: dict[str, jax.Array],
         a: dict[str, jax.Array], b: dict[str, jax.Array], scale: jax.Array,
         bp: dict[str, jax.Array], products: dict[str, Any]) -> jax.Array:
    """Every layer's four products of one form, each output the next one's input (`bp`:
    B panel by panel, model/lora_layout.py `b_panels`, as the runner holds it)."""
    dt = x.dtype
    for layer in range(LAYERS):
        for name, (members, offsets, n, adds) in products.items():
            k = PROJECTIONS[members[0]][0]
            xin, res = x[:, :k], (x[:, :n] if adds else None)
            am, bm = tuple(a[m] for m in members), tuple(b[m] for m in members)
            if form == "fused":
                y = native.row_gemm_lora(xin, w[name], n, layer, am, bm, offsets, scale, slots,
                                         residual=res, b_panels=tuple(bp[m] for m in members))
            else:
                y = native.row_gemm(xin, w[name], n, layer,
                                    residual=res if dt == jnp.bfloat16 else None)
                if res is not None and dt == jnp.float32:
                    y = res + y  # the float32 product's residual, as primitives.product
                if form == "separate":
                    y = native.lora_apply_native(xin, y, am, bm, offsets, scale, slots, layer)
            y = y if y.shape[1] >= x.shape[1] else jnp.concatenate([y, x[:, y.shape[1]:]], 1)
            x = (y[:, :x.shape[1]] * 0.5).astype(dt)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--apart", action="store_true", help="q, k and v as three products")
    args = ap.parse_args()
    products = APART if args.apart else PRODUCTS
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def rnd(*shape: int, sc: float = 0.05) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * sc, dt)

    pack = jax.jit(jax.vmap(native.pack_panels))
    w = {name: pack(rnd(LAYERS, PROJECTIONS[ms[0]][0], n))
         for name, (ms, _, n, _) in products.items()}
    a = {m: rnd(LAYERS, SLOTS, k, RANK) for m, (k, _) in PROJECTIONS.items()}
    b = {m: rnd(LAYERS, SLOTS, RANK, n) for m, (_, n) in PROJECTIONS.items()}
    scale = jnp.ones((SLOTS,), jnp.float32)
    bp = {m: jnp.asarray(lora_layout.b_panels(np.asarray(v))) for m, v in b.items()}
    x0 = rnd(1, 2 * INTER, sc=1.0)
    forms = {k: v for k, v in FORMS.items()
             if v[0] != "fused" or hasattr(native, "row_gemm_lora")}
    programs: dict[str, Any] = {
        k: jax.jit(lambda x, s, w, a, b, f=f: step(x, s, f, w, a, b, scale, bp, products))
        for k, (f, _) in forms.items()}
    slots = {k: jnp.asarray([s], jnp.int32) for k, (_, s) in forms.items()}
    out = {k: np.asarray(programs[k](x0, slots[k], w, a, b)) for k in forms}
    if "fused" in out:
        assert np.array_equal(out["fused"], out["separate"]), "fused != separate"
        assert np.array_equal(out["fused0"], out["base"]), "fused0 != base"
    print(f"separate output sha256 {hashlib.sha256(out['separate'].tobytes()).hexdigest()[:12]}")
    times: dict[str, list[float]] = {k: [] for k in forms}
    for i in range(args.rounds):
        for k in (list(forms) if i % 2 == 0 else list(forms)[::-1]):
            t0 = time.perf_counter()
            for _ in range(10):
                y = programs[k](x0, slots[k], w, a, b)
            y.block_until_ready()
            times[k].append((time.perf_counter() - t0) / 10 * 1e3)

    def diff(p: str, q: str) -> str:
        if p not in times or q not in times:
            return "-"
        return f"{np.median(np.array(times[p]) - np.array(times[q])):.3f}"

    print(" | ".join(f"{k}: median {np.median(v):.3f} best {min(v):.3f} ms"
                     for k, v in times.items()))
    print(f"separate - base {diff('separate', 'base')} | fused - base {diff('fused', 'base')}"
          f" | fused0 - base {diff('fused0', 'base')} | fused - fused0 "
          f"{diff('fused', 'fused0')} ms (medians of the per-round differences)")


if __name__ == "__main__":
    main()
