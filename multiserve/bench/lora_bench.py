"""`multiserve bench --lora-adapters N [--lora-rank R]`: what serving LoRA adapters costs.

In one invocation, two engines: the base model alone (an engine without LoRA:
max_loras_per_batch 0) and one with N adapters loaded, every request of its runs with one
(request i with adapter i mod N). Both are started and warmed up, then their runs
alternate, base, LoRA, LoRA, base, ... (so a drift of a shared machine's speed weighs on
both alike), `--rounds` runs each (default 5): batch mode (default 64 x 128, all prompts
at once: ours.py `run_once`) or `--single-stream` (1 x 64: one cold stream of one prompt
with adapter 0, single.py `stream_once`). A side's tok/s is all its tokens over its
summed walls (`combined`). The ratio LoRA / base, checked against the issue's target
(batch 0.85, single stream 0.9), is the median over the pairs (run i of each side, next
to each other in time) of their tok/s ratio: a shared machine's load that changes
between pairs moves it less than the ratio of the two sides' totals, also reported.
Prints both rows and the ratios, then ONE JSON line.

The adapters are random, seeded and PEFT-shaped (`random_adapter_tensors`): rank R on all
seven target modules (q, k, v, o, gate, up, down) of every layer, lora_alpha = R, loaded
from memory (`Engine.load_lora_adapter(tensors=...)`). Their values do not change the
work a step does (zeros would cost the same: the forward never skips a zero).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from multiserve.bench.options import BenchOptions
from multiserve.bench.prompts import bench_prompts
from multiserve.bench.report import HEADER, ratio, run_row
from multiserve.bench.stats import peak_rss_mb as _peak_rss_mb
from multiserve.config import ModelConfig
from multiserve.model.lora_layout import LORA_MODULES, module_shapes

TARGET_BATCH = 0.85  # issue 47 goal 6: 64 x 128 over 4 adapters >= 0.85x the base alone
TARGET_SINGLE = 0.9  # single stream with an adapter >= 0.9x without
# the PEFT block of each target module
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def adapter_name(i: int) -> str:
    return f"bench-lora-{i}"


def random_adapter_tensors(cfg: ModelConfig, rank: int, seed: int) -> dict[str, np.ndarray]:
    """PEFT-named lora_A [r, in] / lora_B [out, r] (float32) of all seven target modules
    in every layer, seeded: A ~ N(0, 1/in), B ~ N(0, 1e-4 / r) (a small delta, so the
    outputs stay those of a language model)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    shapes = module_shapes(cfg)
    for layer in range(cfg.num_layers):
        for ours, peft in LORA_MODULES.items():
            k, n = shapes[ours]
            base = f"base_model.model.model.layers.{layer}.{_BLOCK[peft]}.{peft}"
            out[f"{base}.lora_A.weight"] = (rng.standard_normal((rank, k), np.float32)
                                            / np.float32(np.sqrt(k)))
            out[f"{base}.lora_B.weight"] = (rng.standard_normal((n, rank), np.float32)
                                            * np.float32(0.01 / np.sqrt(rank)))
    return out


def check_lora_options(options: BenchOptions) -> None:
    """Fail before compiling on a LoRA comparison the bench does not run."""
    if options.lora_adapters < 1 or options.lora_rank < 1:
        raise SystemExit("bench: --lora-adapters and --lora-rank must be >= 1")
    clash = [flag for flag, on in (("--fleet", options.fleet),
                                   ("--peer", options.peer != "none"),
                                   ("--ab-speculation", options.ab_speculation),
                                   ("--ab-overlap", options.ab_overlap)) if on]
    if clash:
        raise SystemExit(f"bench: --lora-adapters compares with the base model; it runs "
                         f"without {', '.join(clash)}")


def lora_main(options: BenchOptions, cfg: Any,
              start: Callable[[Any], tuple[Any, float, dict[str, Any]]]) -> int:
    """Both engines started (`start(cfg)`: the engine, its start-up seconds and its step
    info, as bench/run.py starts one) and warmed up, then their runs alternated (module
    docstring); prints the table and the JSON line."""
    n_adapters, rank = options.lora_adapters, options.lora_rank
    configs = {"base": cfg.with_updates(max_loras_per_batch=0, lora_paths=()),
               "lora": cfg.with_updates(max_loras_per_batch=max(cfg.max_loras_per_batch,
                                                                n_adapters),
                                        max_lora_rank=rank)}
    temperature, seed = float(options.temperature), int(options.seed)
    engines: dict[str, Any] = {}
    sides: dict[str, dict[str, Any]] = {}
    try:
        for side, side_cfg in configs.items():
            engine, startup_s, info = start(side_cfg)
            engines[side] = engine
            names: list[str | None] = [None]
            if side == "lora":
                for i in range(n_adapters):
                    res = engine.load_lora_adapter(
                        adapter_name(i), tensors=random_adapter_tensors(
                            engine.model_config, rank, seed + 1000 + i),
                        r=rank, lora_alpha=float(rank))
                    if not res.ok:
                        raise RuntimeError(f"LoRA adapter {adapter_name(i)}: {res.message}")
                names = [adapter_name(i) for i in range(n_adapters)]
            sides[side] = {"names": names, "runs": [], "startup_s": startup_s,
                           "all_compiled_s": info["all_compiled_s"], "dtype": info["dtype"],
                           "model": engine.model_name,
                           "device": f"{engine.devices[0].platform}:{side_cfg.device_indexes}"}
            _measure(engine, options, configs[side], names, temperature, seed, warmup=True)
        for i in range(options.rounds):
            for side in ("base", "lora") if i % 2 == 0 else ("lora", "base"):
                sides[side]["runs"].append(_measure(engines[side], options, configs[side],
                                                    sides[side]["names"], temperature,
                                                    seed + i))
        for side, engine in engines.items():
            state = engine.get_internal_state()
            sides[side]["cache_miss_count"] = state["cache_miss_count"]
            sides[side]["lora_kernel"] = state.get("lora_kernel")  # None: not reported
    finally:
        for engine in engines.values():
            engine.shutdown()
    result = lora_result(options, sides)
    print("\n".join(lora_report(result)), file=sys.stdout)
    print(json.dumps(result), flush=True)
    return 0


def _measure(engine: Any, options: BenchOptions, cfg: Any, names: list[str | None],
             temperature: float, seed: int, warmup: bool = False) -> dict[str, Any]:
    """One run of the mode on `engine` (batch: every prompt at once, request i with adapter
    i mod N; single stream: one cold stream with adapter 0); `warmup`: a short one."""
    from multiserve.bench.ours import run_once
    from multiserve.bench.single import stream_once

    m = min(int(options.output_len), 4) if warmup else int(options.output_len)
    desc = "warmup" if warmup else ("lora" if names[0] else "base")
    if options.single_stream:
        ids = engine.chat_ids([{"role": "user", "content": bench_prompts(1)[0]}])
        return stream_once(engine, ids, m, rid=f"bench-single-{desc}",
                           temperature=temperature, seed=seed, lora_name=names[0])
    n = min(options.num_prompts, 4) if warmup else options.num_prompts
    prompts = [engine.chat_ids([{"role": "user", "content": text}])
               for text in bench_prompts(n)]
    return run_once(engine, prompts, m, overlap=not cfg.disable_overlap, desc=desc,
                    show_progress=not options.no_progress and not warmup,
                    temperature=temperature, seed=seed,
                    lora_names=[names[i % len(names)] for i in range(n)])


def combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's runs together: tok/s all tokens over the summed walls, TTFT and ITL p50
    the median of the runs' and p99 the largest, each run's tok/s, whether every run
    gave the same output ids (greedy: the engine's determinism) and the prompt tokens
    served from the prefix cache."""
    tokens = sum(int(r["output_tokens"]) for r in runs)
    wall = sum(float(r["wall_s"]) for r in runs)
    return {
        "runs": len(runs), "output_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "runs_tokens_per_s": [float(r["tokens_per_s"]) for r in runs],
        "ttft_p50_s": float(np.median([float(r["ttft_p50_s"]) for r in runs])),
        "ttft_p99_s": max(float(r["ttft_p99_s"]) for r in runs),
        "itl_p50_s": float(np.median([float(r["itl_p50_s"]) for r in runs])),
        "itl_p99_s": max(float(r["itl_p99_s"]) for r in runs),
        "exact_length": all(bool(r["exact_length"]) for r in runs),
        "finish_reasons": sorted({f for r in runs for f in r["finish_reasons"]}),
        "outputs_identical": all(r["output_ids"] == runs[0]["output_ids"] for r in runs),
        # prompt tokens served from the prefix cache (batch mode: every run starts cold,
        # later prompts reuse the chat template's preamble; the single stream's one
        # prompt: none)
        "cached_prompt_tokens": sum(int(r.get("cached_prompt_tokens", 0)) for r in runs),
    }


def lora_result(options: BenchOptions, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON line: both runs, the ratio LoRA / base tok/s and the target."""
    base, lora = sides["base"], sides["lora"]
    single = options.single_stream
    target = TARGET_SINGLE if single else TARGET_BATCH
    totals = ratio(combined(lora["runs"])["tokens_per_s"],
                   combined(base["runs"])["tokens_per_s"])
    pairs = [ratio(lo["tokens_per_s"], b["tokens_per_s"])
             for lo, b in zip(lora["runs"], base["runs"], strict=True)]
    known = [p for p in pairs if p is not None]
    r = float(np.median(known)) if known else None
    return {
        "bench": "multiserve", "mode": "lora_single_stream" if single else "lora_batch",
        "model": base["model"], "device": base["device"], "dtype": base["dtype"],
        "num_prompts": 1 if single else options.num_prompts,
        "output_len": int(options.output_len),
        "pairs": options.rounds,
        "lora": {"adapters": options.lora_adapters, "rank": options.lora_rank,
                 "lora_alpha": float(options.lora_rank),
                 "kernel": lora["lora_kernel"],  # the delta's form (model/layers/lora.py)
                 "target_modules": list(LORA_MODULES.values())},
        "base": {**combined(base["runs"]), "startup_s": base["startup_s"],
                 "all_compiled_s": base["all_compiled_s"]},
        "with_lora": {**combined(lora["runs"]), "startup_s": lora["startup_s"],
                      "all_compiled_s": lora["all_compiled_s"]},
        "ratio": r,  # the median of the pairs' ratios
        "pair_ratios": pairs,
        "ratio_of_totals": totals,
        "peak_rss_mb": _peak_rss_mb(),
        "cache_miss_count": [base["cache_miss_count"], lora["cache_miss_count"]],
        "targets": {"ratio": target, "ratio_met": None if r is None else r >= target,
                    "zero_recompiles_met": base["cache_miss_count"] == 0
                    and lora["cache_miss_count"] == 0},
    }


def lora_report(res: dict[str, Any]) -> list[str]:
    """The human-readable table of `lora_result`."""
    lora = res["lora"]
    shape = (f"1 x {res['output_len']}" if res["mode"] == "lora_single_stream"
             else f"{res['num_prompts']} x {res['output_len']}")
    shape += f", {res['pairs']} alternated runs each"
    r = res["ratio"]
    return [
        f"LoRA vs base: {res['model']} {res['dtype']} on {res['device']}, {shape}; "
        f"{lora['adapters']} adapter(s) of rank {lora['rank']} on "
        f"{', '.join(m.removesuffix('_proj') for m in lora['target_modules'])} "
        f"(delta: {lora['kernel']} form)",
        HEADER,
        run_row("base model alone", res["base"]),
        run_row(f"with {lora['adapters']} adapter(s)", res["with_lora"]),
        f"ratio LoRA / base: {'-' if r is None else f'{r:.3f}'} (median of the pairs "
        f"{', '.join('-' if p is None else f'{p:.3f}' for p in res['pair_ratios'])}; "
        f"of the totals {_fmt(res['ratio_of_totals'])}; target >= "
        f"{res['targets']['ratio']}: {'met' if res['targets']['ratio_met'] else 'NOT met'}); "
        f"recompiles after warm-up: {res['cache_miss_count']}",
    ]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
