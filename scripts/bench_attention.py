"""The native paged attention kernel alone, float32 and bfloat16 pools: SmolLM2-135M's head
layout (9 query heads, 3 KV heads, head_dim 64), pages of 16 slots in random order, one
layer's call timed (median of 7 x 20 calls, jitted).

    python scripts/bench_attention.py                 # times
    python scripts/bench_attention.py --save DIR      # ... and keeps every output
    python scripts/bench_attention.py --check DIR     # ... and compares them bitwise with DIR's

--save before a kernel change and --check after it tell whether the change moved a bit.
Cases: 64 decode rows over 100-220 keys, 1 decode row, a 256-token prefill, 16 decode rows
over 400-520 keys (one layer of a 2-layer pool: its K/V stay in the caches), and
`decode64_30layers`: the 64 decode rows through all 30 layers of a 30-layer pool in one
program (a step's attention: K/V read from memory; median of 7 x 3 calls).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.kernels import native
from multiserve.model.layers.forward_batch import ForwardBatch

LAYERS, KV_HEADS, HEADS, HEAD_DIM, PAGE = 2, 3, 9, 64, 16
STEP_LAYERS = 30  # the decode64_30layers case: SmolLM2-135M's layer count


def _case(rng: np.random.Generator, name: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(positions, token_seq, lengths) of one case."""
    if name == "prefill256":
        return np.arange(256, dtype=np.int32), np.zeros(256, np.int32), [256]
    rows, lo, hi = {"decode64": (64, 100, 220), "decode64_30layers": (64, 100, 220),
                    "decode1": (1, 100, 220), "decode16_long": (16, 400, 520)}[name]
    lens = [int(n) for n in rng.integers(lo, hi, rows)]
    return (np.array([n - 1 for n in lens], np.int32), np.arange(rows, dtype=np.int32), lens)


CASES = ("decode64", "decode1", "prefill256", "decode16_long", "decode64_30layers")


@dataclass(frozen=True)
class Problem:
    """One case's operands: float32 q and K/V (cast per pool dtype by the caller)."""

    name: str
    layers: int  # pool layers; a 30-layer case attends through every one
    calls: int  # calls per timed round
    q: jax.Array
    k: np.ndarray
    v: np.ndarray
    batch: ForwardBatch


def problems(cases: tuple[str, ...] = CASES) -> Iterator[Problem]:
    """The cases in order, from one seeded generator (the same operands in every run)."""
    rng = np.random.default_rng(0)
    for name in CASES:
        layers = STEP_LAYERS if name.endswith("30layers") else LAYERS
        calls = 3 if name.endswith("30layers") else 20
        pos, seq, lens = _case(rng, name)
        pages = [-(-n // PAGE) for n in lens]
        table = np.zeros((len(lens), max(pages) + 1), np.int32)
        order = rng.permutation(sum(pages) + 4)
        for b, (n, start) in enumerate(zip(pages, np.cumsum([0] + pages), strict=False)):
            table[b, :n] = order[start:start + n]
        slots = (sum(pages) + 4) * PAGE
        q = jnp.asarray(rng.standard_normal((len(pos), HEADS, HEAD_DIM)), jnp.float32)
        k = rng.standard_normal((layers, KV_HEADS, slots, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((layers, KV_HEADS, slots, HEAD_DIM)).astype(np.float32)
        zeros = jnp.zeros(len(pos), jnp.int32)
        batch = ForwardBatch(input_ids=zeros, positions=jnp.asarray(pos),
                             token_seq=jnp.asarray(seq), out_slots=zeros,
                             page_table=jnp.asarray(table),
                             seq_lens=jnp.asarray(np.array(lens, np.int32)),
                             logit_rows=zeros[:1])
        if name in cases:
            yield Problem(name, layers, calls, q, k, v, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", type=Path)
    ap.add_argument("--check", type=Path)
    args = ap.parse_args()
    for pb in problems():
        name, layers, calls, q, k, v, batch = (pb.name, pb.layers, pb.calls, pb.q, pb.k,
                                               pb.v, pb.batch)
        for dtype in (jnp.float32, jnp.bfloat16):
            kp, vp = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
            if layers == LAYERS:  # layer 1 of the pool
                call = jax.jit(lambda q, k, v, b: native.paged_attention_native(
                    q, k, v, 1, b, page_size=PAGE))
            else:  # every layer, their outputs stacked

                def call_all(q: jax.Array, k: jax.Array, v: jax.Array, b: ForwardBatch,
                             n: int = layers) -> jax.Array:
                    return jnp.stack([native.paged_attention_native(q, k, v, layer, b,
                                                                    page_size=PAGE)
                                      for layer in range(n)])
                call = jax.jit(call_all)
            out = np.asarray(call(q, kp, vp, batch))
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(calls):
                    r = call(q, kp, vp, batch)
                r.block_until_ready()
                times.append((time.perf_counter() - t0) / calls)
            key = f"{name}_{jnp.dtype(dtype).name}"
            line = f"{key:24s} {np.median(times) * 1e6:9.1f} us  (min {min(times) * 1e6:.1f})"
            if args.check:
                ref = np.load(args.check / f"{key}.npy")
                same = np.array_equal(ref.view(np.uint32), out.view(np.uint32))
                line += "  bitwise" if same else f"  DIFFERS, max {np.abs(ref - out).max():.3g}"
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                np.save(args.save / f"{key}.npy", out)
            print(line, flush=True)


if __name__ == "__main__":
    main()
