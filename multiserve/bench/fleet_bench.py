"""`multiserve bench --fleet`: the fleet under load, against one engine.

The fleet (configs/cpu-4.toml unless --config; on CPU its engines share the same cores
through virtual devices) starts in this process on ephemeral loopback ports. Then, with
the same K prompts (K = number of engines x --clients-per-port, from the fixed list,
chat-templated):
- fleet run: K concurrent streaming HTTP clients, client i on engine (i mod E)'s port;
- one-engine run: the same K requests, all concurrently on engine 0's port.
Each run starts cold (every prefix cache flushed) and all its clients start together at
t0; aggregate tok/s = all output tokens / (last token - t0). The goal (issue 11) is
fleet / one engine >= 0.9: several engines on shared cores must not cost much more than
one engine batching the same requests. Greedy outputs must be identical across the two
runs (a request's output depends neither on the engine nor on the batch).

With `--duration S` the load is sustained instead (chat_load.py): K closed-loop OpenAI
chat clients (mixed max_tokens, greedy or seeded, half streamed) for S seconds on the
fleet, then the same K clients for S seconds on engine 0 alone; the outputs of the
requests both runs finished must be identical.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from multiserve.bench.http_stream import stream_generate
from multiserve.bench.options import BenchOptions
from multiserve.bench.prompts import NUM_BENCH_PROMPTS, bench_prompts
from multiserve.bench.report import fleet_table, ratio
from multiserve.bench.stats import Timeline, summarize, without_output_ids

T = TypeVar("T")
FLEET_LEN = 64
TARGET_FLEET_VS_ONE = 0.9
WARMUP_LEN = 2


def fleet_config(options: BenchOptions) -> Any:
    """The fleet config: --config (default configs/cpu-4.toml), on ephemeral ports, with
    the engine flags of `multiserve bench` applied to every engine."""
    from multiserve.fleet.config_loader import load_fleet_config
    from multiserve.fleet.startup import DEFAULT_CONFIG

    overrides: dict[str, Any] = {"fleet.base_port": 0, "fleet.supervisor_port": 0}
    if options.model:
        overrides["model.path"] = options.model
    for key, value in (("precompile_token_paddings", options.token_paddings),
                       ("precompile_bs_paddings", options.bs_paddings),
                       ("chunked_prefill_size", options.chunked_prefill_size),
                       ("max_total_tokens", options.max_total_tokens),
                       ("max_running_requests", options.max_running)):
        if value is not None:
            overrides[f"engine.{key}"] = list(value) if isinstance(value, tuple) else value
    if options.no_overlap:
        overrides["engine.disable_overlap"] = True
    if options.dtype not in (None, "auto"):
        overrides["engine.dtype"] = options.dtype
    if options.speculative:
        overrides["engine.speculative_algorithm"] = "ngram"
        if options.speculative_num_draft_tokens is not None:
            overrides["engine.speculative_num_draft_tokens"] = (
                options.speculative_num_draft_tokens)
    if options.decode_steps_per_dispatch is not None:
        overrides["engine.decode_steps_per_dispatch"] = options.decode_steps_per_dispatch
    if options.no_progress:
        overrides["engine.show_progress"] = False
    return load_fleet_config(options.config or DEFAULT_CONFIG, overrides)


async def _run_clients(jobs: Sequence[tuple[str, Sequence[int]]], output_len: int
                       ) -> tuple[list[Timeline], float]:
    import httpx

    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        timelines = await asyncio.gather(*(stream_generate(client, url, ids, output_len)
                                           for url, ids in jobs))
    return list(timelines), t0


def _forward_counts(fleet: Any) -> list[int]:
    return [int(w.get_internal_state()["forward_ct"]) for w in fleet.workers]


def _cold(fleet: Any, run: Callable[[], T]) -> tuple[T, list[int]]:
    """run() on the fleet with every prefix cache flushed first: its value, and how many
    steps each engine ran meanwhile."""
    for w in fleet.workers:
        flushed = w.engine.flush_cache()
        assert flushed.ok, f"bench: cannot flush engine {w.index}: {flushed.message}"
    before = _forward_counts(fleet)
    value = run()
    after = _forward_counts(fleet)
    return value, [b - a for a, b in zip(before, after, strict=True)]


def measure(fleet: Any, jobs: Sequence[tuple[str, Sequence[int]]], output_len: int
            ) -> dict[str, Any]:
    """One cold run of `jobs` (engine URL, prompt ids), all started together."""
    (timelines, t0), steps = _cold(fleet, lambda: asyncio.run(_run_clients(jobs, output_len)))
    figures: dict[str, Any] = dict(summarize(timelines, t0))
    figures.update({
        "clients": [url for url, _ in jobs],
        "steps_per_engine": steps,
        "finish_reasons": sorted({str(t.finish_reason) for t in timelines}),
        "exact_length": all(len(t.output_ids) == output_len for t in timelines),
        "output_ids": [list(t.output_ids) for t in timelines],
    })
    return figures


def _start(cfg: Any, log: Any) -> tuple[Any, float, float]:
    """The fleet `cfg` started, every engine's buckets compiled (measured with every bucket,
    as a long-running fleet has): (fleet, seconds to READY, seconds to all compiled)."""
    from multiserve.fleet.launch import launch_fleet

    t_start = time.perf_counter()
    fleet = launch_fleet(cfg, announce=False, log=log or sys.stderr)
    startup_s = time.perf_counter() - t_start  # to READY
    try:
        for w in fleet.workers:
            w.wait_compiled()
    except BaseException:
        fleet.stop("abort")
        raise
    return fleet, startup_s, time.perf_counter() - t_start


def run_fleet_bench(cfg: Any, output_len: int, log: Any = None,
                    clients_per_port: int = 1, duration_s: float | None = None
                    ) -> dict[str, Any]:
    """Start the fleet `cfg`, run both measurements with `clients_per_port` clients on each
    engine's port, stop it; the JSON-ready result. `duration_s`: the sustained chat load
    (chat_load.py) for that long on each side instead of one wave of `output_len`-token
    streams."""
    fleet, startup_s, all_compiled_s = _start(cfg, log)
    try:
        if duration_s is not None:
            body = _sustained(fleet, clients_per_port, duration_s)
        else:
            body = _one_wave(fleet, clients_per_port, output_len)
        misses = [int(w.get_internal_state()["cache_miss_count"]) for w in fleet.workers]
        model_name = fleet.workers[0].model_name
        groups = fleet.device_groups
    finally:
        fleet.stop("abort")
    r = ratio(body["fleet"]["tokens_per_s"], body["one_engine"]["tokens_per_s"])
    return {
        "bench": "multiserve", "mode": "fleet", "model": model_name,
        "num_engines": len(groups), "device_groups": groups,
        "num_clients": len(groups) * clients_per_port, "clients_per_port": clients_per_port,
        "output_len": output_len, "duration_s": duration_s, "startup_s": startup_s,
        "all_compiled_s": all_compiled_s, **body,
        "tokens_per_s": body["fleet"]["tokens_per_s"], "ratio": r,
        "target": TARGET_FLEET_VS_ONE, "cache_miss_count": misses,
        "targets": {"fleet_vs_one": TARGET_FLEET_VS_ONE,
                    "fleet_vs_one_met": None if r is None else r >= TARGET_FLEET_VS_ONE,
                    "zero_recompiles_met": not any(misses)},
    }


def _one_wave(fleet: Any, clients_per_port: int, output_len: int) -> dict[str, Any]:
    """Every client sends one greedy `output_len`-token stream at the same time."""
    urls = fleet.urls
    engine0 = fleet.workers[0].engine
    prompts = [engine0.chat_ids([{"role": "user", "content": text}])
               for text in bench_prompts(len(urls) * clients_per_port)]
    spread_jobs = [(urls[i % len(urls)], p) for i, p in enumerate(prompts)]
    measure(fleet, spread_jobs, WARMUP_LEN)  # warm the HTTP path on every port
    spread = measure(fleet, spread_jobs, output_len)
    one = measure(fleet, [(urls[0], p) for p in prompts], output_len)
    lens = [len(p) for p in prompts]
    return {"prompt_tokens": {"total": sum(lens), "min": min(lens), "max": max(lens),
                              "mean": sum(lens) / len(lens)},
            "fleet": without_output_ids(spread),
            "one_engine": without_output_ids(one),
            "outputs_identical": spread["output_ids"] == one["output_ids"]}


def _sustained(fleet: Any, clients_per_port: int, duration_s: float) -> dict[str, Any]:
    """The sustained chat load on the fleet (client i on port i mod E), then the same
    clients all on engine 0; each side cold (caches flushed). Outputs of the requests
    both sides finished must be identical (greedy, or seeded)."""
    from multiserve.bench.chat_load import run_chat_load

    urls = fleet.urls
    model = fleet.workers[0].model_name
    n = len(urls) * clients_per_port
    prompts = bench_prompts(NUM_BENCH_PROMPTS)  # every prompt once per cycle
    run_chat_load(urls, model, prompts, 0.0)  # warm the HTTP and chat path on every port
    sides: dict[str, Any] = {}
    texts: dict[str, dict[tuple[int, int], str]] = {}
    for side, side_urls in (("fleet", [urls[i % len(urls)] for i in range(n)]),
                            ("one_engine", [urls[0]] * n)):
        (sides[side], texts[side]), steps = _cold(
            fleet, lambda urls=side_urls: run_chat_load(urls, model, prompts, duration_s))
        sides[side].update({"steps_per_engine": steps, "clients": side_urls})
    both = sorted(set(texts["fleet"]) & set(texts["one_engine"]))
    return {**sides, "compared_requests": len(both),
            "outputs_identical": all(texts["fleet"][k] == texts["one_engine"][k]
                                     for k in both)}


def fleet_main(options: BenchOptions) -> int:
    if options.peer != "none":
        raise SystemExit("bench: --fleet compares the fleet with one engine; no --peer")
    m = int(options.output_len) if options.output_len is not None else FLEET_LEN
    if m < 1:
        raise SystemExit("bench: --output-len must be >= 1")
    per_port = options.clients_per_port
    if per_port < 1:
        raise SystemExit("bench: --clients-per-port must be >= 1")
    duration = options.duration
    if duration is not None and duration <= 0:
        raise SystemExit("bench: --duration must be > 0 seconds")
    result = run_fleet_bench(fleet_config(options), m, clients_per_port=per_port,
                             duration_s=duration)
    print("\n".join(["", *fleet_table(result)]), file=sys.stdout)
    print(json.dumps(result), flush=True)
    return 0
