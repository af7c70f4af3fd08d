"""One measured run of a started multiserve Engine: N prompts at once, M tokens each.

Sampling: greedy by default; `temperature > 0` samples, request i with seed `seed + i`
(top_p / top_k / min_p at their defaults), so a run is reproducible and two runs with
the same seed give the same ids (the engine's draws are keyed by seed and position).

How a run goes: flush the prefix cache (every run starts cold, like the peer), pause
the engine in place, submit every request (streaming, so each token's arrival is
timed), then continue: t0 is the moment of `continue_generation`, so all requests
arrive together and the first step sees the whole queue. Token timestamps are taken
in the request sink, on the engine thread, when the host reads each token.

The overlap A/B switches `EngineCore.overlap` on the engine thread while the engine
is idle and drained: both runs use the same compiled executables and KV pool and
differ only in scheduling (step N+1 launched before step N is read, or not).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from multiserve.bench.stats import Timeline, summarize
from multiserve.engine.commands import SetOverlap
from multiserve.types import GenerateRequest, OutputDelta, SamplingParams


def set_overlap(engine: Any, on: bool) -> None:
    engine.call(SetOverlap(on)).result()


def spec_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A run's speculative decoding: verify rows, draft tokens proposed and accepted, the
    acceptance rate and the tokens each verify row emitted on average (1 + accepted)."""
    verify = after["spec_verify_ct"] - before["spec_verify_ct"]
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"spec_verify_ct": verify, "spec_proposed_tokens": proposed,
            "spec_accepted_tokens": accepted,
            "spec_acceptance": accepted / proposed if proposed else None,
            "spec_accept_length": 1.0 + accepted / verify if verify else None}


def request_params(output_len: int, temperature: float, seed: int, index: int
                   ) -> SamplingParams:
    """The sampling of bench request `index`: exactly `output_len` tokens (ignore_eos),
    `temperature` (0 = greedy), seed `seed + index` (unused when greedy)."""
    return SamplingParams(max_new_tokens=output_len, temperature=float(temperature),
                          seed=int(seed) + index, ignore_eos=True)


def run_once(engine: Any, prompts: Sequence[Sequence[int]], output_len: int, *,
             overlap: bool, desc: str, show_progress: bool = True, temperature: float = 0.0,
             seed: int = 0, lora_names: Sequence[str | None] | None = None
             ) -> dict[str, Any]:
    """One measured run (see the module docstring); request i runs with the LoRA adapter
    `lora_names[i]` (None, or no list: the base model)."""
    set_overlap(engine, overlap)
    flushed = engine.flush_cache()
    assert flushed.ok, f"bench: cannot flush before a run: {flushed.message}"
    before = engine.get_internal_state()
    timelines: dict[str, Timeline] = {}
    counters = {"tokens": 0, "done": 0}
    all_done = threading.Event()
    errors: list[str] = []
    n = len(prompts)

    def make_sink(tl: Timeline):  # noqa: ANN202
        ids: list[int] = []

        def sink(out: OutputDelta) -> None:  # engine thread: keep it cheap
            ids.extend(out.new_ids)
            counters["tokens"] += tl.record(time.perf_counter(), len(ids))
            if out.finished:
                tl.finished_at = tl.events[-1][0] if tl.events else time.perf_counter()
                tl.finish_reason = out.finish_reason
                tl.output_ids = tuple(ids)
                tl.cached_tokens = out.cached_tokens
                if out.error:
                    errors.append(out.error)
                counters["done"] += 1
                if counters["done"] == n:
                    all_done.set()
        return sink

    engine.pause_generation("in_place")
    try:
        for i, ids in enumerate(prompts):
            rid = f"bench-{desc}-{i}"
            timelines[rid] = Timeline()
            params = request_params(output_len, temperature, seed, i)
            lora = None if lora_names is None else lora_names[i]
            engine.submit(GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=params,
                                          stream=True, lora_name=lora),
                          make_sink(timelines[rid]))
    finally:
        t0 = time.perf_counter()
        engine.continue_generation()
    _wait(engine, all_done, counters, n * output_len, desc, show_progress)
    if errors:
        raise RuntimeError(f"bench: the engine failed during the run: {errors[0]}")
    after = engine.get_internal_state()
    ordered = [timelines[f"bench-{desc}-{i}"] for i in range(n)]
    steps = after["forward_ct"] - before["forward_ct"]
    figures = summarize(ordered, t0)
    figures.update({
        "overlap": overlap,
        "steps": steps,
        "decode_steps": after["forward_ct_decode"] - before["forward_ct_decode"],
        "mean_step_ms": 1000.0 * float(figures["wall_s"]) / steps if steps else float("nan"),
        "cached_prompt_tokens": sum(t.cached_tokens for t in ordered),
        "finish_reasons": sorted({str(t.finish_reason) for t in ordered}),
        "exact_length": all(len(t.output_ids) == output_len for t in ordered),
        "cache_miss_count": after["cache_miss_count"],
        "retractions": after["num_retractions"] - before["num_retractions"],
        **spec_counts(before, after),
    })
    flushed = engine.flush_cache()
    state = engine.get_internal_state()
    figures["kv_returned"] = bool(flushed.ok and state["available_kv_tokens"]
                                  == state["initial_available_kv_tokens"])
    figures["output_ids"] = [list(t.output_ids) for t in ordered]
    return figures


def _wait(engine: Any, done: threading.Event, counters: dict[str, int], total: int, desc: str,
          show_progress: bool) -> None:
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"ours {desc}", unit="tok", leave=False)
    shown = 0
    try:
        while not done.wait(0.25):
            healthy, reason = engine.health()
            if not healthy:
                raise RuntimeError(f"bench: the engine became unhealthy: {reason}")
            if bar is not None:
                now = counters["tokens"]
                bar.update(now - shown)
                shown = now
    finally:
        if bar is not None:
            bar.update(counters["tokens"] - shown)
            bar.close()
