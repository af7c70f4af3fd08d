"""The Python of one steady decode step's host path, alone: no model, no device.

`python scripts/host_path_probe.py [ROWS] [STEPS]` builds one Scheduler with ROWS
decoding requests (prompt i: 40 + i tokens; sampled at the default temperature; no prefix
sharing), padded to 64 tokens and rows (the bench's largest bucket), then times each
of the step's host stages for STEPS steps in the order EngineCore runs them: schedule,
build_step_arrays, step_rows, the SamplingBatch (both as the core runs them: the step
before's reused where SteadyRows can, engine/step_inputs/steady_rows.py), packing the two
program inputs, Scheduler.launch, Scheduler.postprocess, and each Req's next delta handed
to a sink that only keeps it. It prints the median ms of each stage (the first 50 steps
dropped) and their sum. Without a device nothing shares the cores with it, so it shows
what the host's own work costs where `multiserve bench --host-phases` shows it inside the
engine, under the device step's threads (docs/performance.md §23). Run it under
`flock /tmp/bench.lock`.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from multiserve.config import EngineConfig
from multiserve.engine.sched.page_allocator import PageAllocator
from multiserve.engine.sched.prefix_cache import PrefixCache
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.scheduler import Scheduler
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.step_inputs.program_inputs import sampling_inputs, step_inputs
from multiserve.engine.step_inputs.row_specs import step_rows
from multiserve.engine.step_inputs.sampling_batch import (
    build_sampling_batch,
    mask_words,
    mask_zeros,
    penalty_zeros,
)
from multiserve.engine.step_inputs.steady_rows import SteadyRows
from multiserve.engine.step_inputs.token_arrays import build_step_arrays
from multiserve.types import GenerateRequest, OutputDelta, SamplingParams

VOCAB = 49152  # the default tokenizer's
PAGE = 16
STAGES = ("schedule", "arrays", "rows", "sampling", "pack", "advance", "postprocess",
          "deliver")


def probe(rows: int, steps: int) -> dict[str, float]:
    """Median ms of each stage over `steps` decode steps of `rows` rows."""
    cfg = EngineConfig()
    allocator = PageAllocator(8192, PAGE)
    sched = Scheduler(cfg, allocator, PrefixCache(allocator, PAGE, enabled=True), 4096, 512,
                      128)
    rules = StopRules(frozenset([2]), 4096, None)
    kept: list[OutputDelta] = []
    for i in range(rows):
        request = GenerateRequest(rid=f"r{i}", input_ids=tuple(range(3 + i, 43 + 2 * i)),
                                  sampling=SamplingParams(max_new_tokens=steps + 150,
                                                          ignore_eos=True),
                                  stream=True)
        for req in Req.samples_of(request, i, kept.append):
            sched.add(req)
    ids = [5] * 128
    while sched.waiting or any(r.in_prefill for r in sched.running):  # the prefills
        batch = sched.schedule()
        assert batch is not None
        sched.launch(batch)
        sched.postprocess(batch, ids, None, "v", rules)
    padded = 64  # the step's token and row bucket
    assert rows <= padded, rows
    zeros, no_masks = penalty_zeros(padded, VOCAB), mask_zeros(padded, VOCAB)
    steady = SteadyRows()

    def zeros_for(_: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return zeros.output_counts, zeros.prompt_mask, no_masks

    took: dict[str, list[float]] = {s: [] for s in STAGES}
    for _ in range(steps):
        t = [time.perf_counter()]
        batch = sched.schedule()
        assert batch is not None and len(batch.rows) == rows
        t.append(time.perf_counter())
        arrays = build_step_arrays(batch, padded, padded, 128, 256, PAGE)
        t.append(time.perf_counter())
        reused = steady.reuse(batch, padded, zeros_for)
        if reused is None:  # the engine's path (`StepInputs.build`)
            specs, wants_lp = step_rows(batch, rules, mask_words(VOCAB))
            t.append(time.perf_counter())
            sb = build_sampling_batch(specs, padded, VOCAB, zeros=zeros, no_masks=no_masks)
            steady.keep(batch, padded, specs, sb, wants_lp)
        else:
            t.append(time.perf_counter())
            sb = reused[0]
        t.append(time.perf_counter())
        step_inputs(arrays)
        sampling_inputs(sb)
        t.append(time.perf_counter())
        sched.launch(batch)
        t.append(time.perf_counter())
        deliver = sched.postprocess(batch, ids, None, "v", rules)
        t.append(time.perf_counter())
        for req in deliver:
            req.sink(req.next_delta("v"))
        t.append(time.perf_counter())
        kept.clear()
        for stage, a, b in zip(STAGES, t, t[1:], strict=False):
            took[stage].append(b - a)
    return {s: 1000.0 * float(np.median(v[50:])) for s, v in took.items()}


def main() -> int:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 250
    ms = probe(rows, steps)
    for stage, value in ms.items():
        print(f"{stage:<12}{value:8.3f} ms")
    print(f"{'total':<12}{sum(ms.values()):8.3f} ms  ({rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
