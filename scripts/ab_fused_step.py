"""A/B of one decode step: the engine's fused program (S) against its two programs (T, then
R), in one process, on the same arrays, rounds alternating in order.

    PYTHONPATH=. python scripts/ab_fused_step.py --rows 1 --rounds 40 [--dtype bfloat16]

Each round times 10 pipelined steps (each reading the previous step's sampled ids on the
device, as the engine's overlap does) of one form; prints both forms' median and best ms
a step, the median of the per-round ratios fused/separate, and whether every output
(ids, logprobs, top logprobs) was bitwise the same in every round. Uses the default model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import numpy as np

import multiserve.bench.breakdown as B
from multiserve.config import EngineConfig
from multiserve.engine.commands import Call
from multiserve.engine.device.programs import ProgramKind
from multiserve.engine.engine import Engine
from multiserve.engine.step_inputs.program_inputs import sampling_inputs, step_inputs


def measure(core: Any, rows: int, rounds: int) -> str:
    runner = core.runner
    shape = B.step_shape(core, [90] * rows, 64)
    t = runner.programs.get(ProgramKind.FORWARD, shape.tokens)
    r = runner.programs.get(ProgramKind.HEAD, shape.logit_rows)
    fused = runner.step_programs.fused(shape.tokens, shape.logit_rows)
    if fused is None:
        raise SystemExit(f"no fused program for T={shape.tokens}, R={shape.logit_rows}")
    arrays = B.decode_arrays(shape, runner.page_table_rows(shape.tokens), runner.max_rows,
                             core.max_pages, core.page_size, runner.num_pages,
                             runner.model_cfg.vocab_size)
    step, params = step_inputs(arrays), runner.compute_params
    sb = sampling_inputs(B._sampler_batch(runner, shape, 64, 0.0, 0))
    prev = {k: jax.device_put(np.zeros(runner.max_rows, np.int32), runner.replicated)
            for k in ("separate", "fused")}
    times: dict[str, list[float]] = {k: [] for k in prev}
    outs: dict[str, list[Any]] = {k: [] for k in prev}
    for i in range(rounds):
        for form in ("separate", "fused") if i % 2 == 0 else ("fused", "separate"):
            t0 = time.perf_counter()
            for _ in range(10):
                if form == "separate":
                    hidden, tok, row_prev, runner.kv = t(params, runner.kv, prev[form], step)
                    next_ids, out = r(params, hidden, tok, row_prev, *sb)
                else:
                    next_ids, out, runner.kv = fused(params, runner.kv, prev[form], step, *sb)
                prev[form] = next_ids
            jax.block_until_ready(out)
            times[form].append((time.perf_counter() - t0) / 10 * 1e3)
            outs[form].append([np.asarray(a).tobytes() for a in jax.tree.leaves(out)])
    same = outs["separate"] == outs["fused"]
    ratio = np.median(np.array(times["fused"]) / np.array(times["separate"]))
    return (" | ".join(f"{k}: median {np.median(v):.2f} best {min(v):.2f} ms"
                       for k, v in times.items())
            + f" | fused/separate median of round ratios {ratio:.3f} | outputs bitwise "
              f"the same: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    engine = Engine(EngineConfig(dtype=args.dtype, show_progress=False,
                                 compile_in_background=False))
    try:
        print(engine.call(Call(lambda core: measure(core, args.rows, args.rounds))).result())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
