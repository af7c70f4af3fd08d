"""`multiserve bench`: offline throughput of one Engine on the default model, optionally
against a peer (HF transformers, vLLM CPU or llama.cpp, each in a subprocess with its own
environment) in the same run.

Modes:
- batch (default, 64 x 128): N prompts from the fixed list (prompts.py), chat-templated,
  all submitted at once, ignore_eos, exactly M output tokens each (ours.py);
  `--ab-overlap` also runs overlap scheduling off (or on) for the ratio; then the
  step-time breakdown of the run's typical decode step (breakdown.py: forward, products,
  attention, other device work, sampler, host, against the wall time per decode step;
  `--no-breakdown` skips it); `--host-phases` also times the measured run's engine
  thread phase by phase (engine/host_phases.py) and prints that table;
- `--single-stream` (1 x 64): one prompt streamed through Engine.stream_sync, TTFT and
  tok/s (single.py);
- `--fleet`: the 4-engine fleet with `--clients-per-port` streaming clients per port vs
  one engine with the same requests (fleet_bench.py); with `--duration S`, closed-loop
  chat clients for S seconds per side instead (chat_load.py);
- `--lora-adapters N [--lora-rank R]` (batch or single stream): the base model alone,
  then the same run with N random adapters loaded, and the ratio (lora_bench.py);
- `--agent-sessions S [--agent-turns T]`: a multi-turn agent workload on the fleet
  through its front door vs the engine ports at random (vs sglang-router when
  installed): prefix hit rate and tok/s per arm (agent_bench.py).
`--random-model tiny|small|1b` runs on a random-weight model of that shape
(random_model.py, written once into the cache) instead of `--model`.
Sampling: greedy by default; `--temperature T` samples every request at T (top_p / top_k
/ min_p off) with request i seeded `--seed S` + i, ours and the peer's alike (where the
peer allows a seed per request; its JSON says how it seeded). Sampled outputs of two
engines are not expected to agree, so the peer agreement is null then, with the reason.
The RL-rollout-like workload is `--num-prompts 16 --output-len 768` (add `--temperature 1
--seed S` for its sampled variant): the default KV pool (32768 tokens on CPU) and context
limit (4096) hold it, and nothing else caps the output length.
What is measured: start-up (Engine construction: load + compile every bucket), a short
warm-up (excluded), then tokens/s (output tokens / wall), TTFT p50/p99, ITL p50/p99,
steps, peak RSS, recompiles after warm-up (`cache_miss_count`, must stay 0). `--peer
hf|vllm|llamacpp` runs the same token ids through the peer (peer.py) and prints ours vs
theirs as a table, with the ratio and how far the greedy outputs agree.
Ends with ONE JSON line on stdout holding every figure (progress bars go to stderr).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from multiserve.bench.options import BenchOptions
from multiserve.bench.prompts import bench_prompts
from multiserve.bench.report import batch_report, single_report
from multiserve.bench.stats import agreement, without_output_ids
from multiserve.bench.stats import peak_rss_mb as _peak_rss_mb
from multiserve.engine.commands import StepInfo

TARGET_VS_PEER = 1.2  # issue 19: 64 x 128 and 16 x 768 at >= 1.2x vLLM-CPU
TARGET_OVERLAP = 1.1
BATCH_LEN = 128  # the table: 64 prompts x 128 tokens
SINGLE_STREAM_LEN = 64  # and 1 prompt x 64 tokens


def _engine_config(options: BenchOptions) -> Any:
    """The default EngineConfig, changed only where a flag says so (errors name the
    field: ConfigError)."""
    from multiserve.config import EngineConfig

    base = EngineConfig()
    changes: dict[str, Any] = {"model_path": options.model,
                               "disable_overlap": bool(options.no_overlap),
                               "show_progress": not options.no_progress}
    if options.dtype is not None:
        changes["dtype"] = options.dtype
    for name, value in (("precompile_token_paddings", options.token_paddings),
                        ("precompile_bs_paddings", options.bs_paddings),
                        ("chunked_prefill_size", options.chunked_prefill_size),
                        ("max_total_tokens", options.max_total_tokens),
                        ("decode_steps_per_dispatch", options.decode_steps_per_dispatch)):
        if value is not None:
            changes[name] = value
    if options.ab_speculation or options.speculative:
        changes["speculative_algorithm"] = "ngram"
        if options.speculative_num_draft_tokens is not None:
            changes["speculative_num_draft_tokens"] = options.speculative_num_draft_tokens
    bs = changes.get("precompile_bs_paddings", base.precompile_bs_paddings)
    if options.max_running is not None:
        changes["max_running_requests"] = options.max_running
        if options.max_running > max(bs):
            changes["precompile_bs_paddings"] = tuple(bs) + (options.max_running,)
    elif max(bs) < base.max_running_requests:
        changes["max_running_requests"] = max(bs)
    if "chunked_prefill_size" not in changes:
        tokens = changes.get("precompile_token_paddings", base.precompile_token_paddings)
        changes["chunked_prefill_size"] = min(base.chunked_prefill_size, max(tokens))
    return base.with_updates(**changes)


def _peer_dtype(cfg: Any) -> str:
    """The dtype the peer computes in: the one the engine resolves its config to
    (engine/base/dtype_choice.py), so both run like for like."""
    import jax

    from multiserve.engine.setup import resolve_dtype
    from multiserve.model.loading.loader import resolve_model_dir

    model_dir = None if cfg.model_path is None else resolve_model_dir(cfg.model_path)
    return resolve_dtype(cfg, jax.devices()[:1], model_dir).dtype


def _peer_model(options: BenchOptions) -> str:
    """The model the peer loads: --peer-model, else the engine's model in the form the
    peer reads (an HF dir; for llama.cpp an F32 copy of the engine's .gguf, the weights
    the engine computes with: gguf_f32.py), else the default model's."""
    if options.peer_model:
        return str(options.peer_model)
    gguf = options.peer == "llamacpp"
    if options.model is None:
        from multiserve.model.loading.default_model import default_model_path, find_default_gguf

        return str(_gguf_copy(find_default_gguf(), options) if gguf else default_model_path())
    if gguf and str(options.model).endswith(".gguf"):
        return str(_gguf_copy(Path(options.model), options))
    if not gguf and Path(options.model, "config.json").is_file():
        return str(options.model)
    kind = "a .gguf file" if gguf else "a Hugging Face model directory (config.json)"
    raise SystemExit(f"bench: --peer {options.peer} needs {kind}; got {options.model!r} "
                     "(give one with --peer-model)")


def _gguf_copy(gguf: Path, options: BenchOptions) -> Path:
    """The de-quantized copy of `gguf` in the engine's dtype (F32 or BF16) for llama.cpp."""
    from multiserve.bench.gguf_f32 import dtype_copy

    kind = "BF16" if options.peer_dtype == "bfloat16" else "F32"
    print(f"bench: llama.cpp peer reads a {kind} copy of {gguf.name} (--peer-model for "
          "another)", flush=True)
    return dtype_copy(gguf, kind)


def _run_peer(options: BenchOptions, model: str, prompts: list[list[int]], m: int,
              stream: bool, show: bool, first_request: int = 0) -> dict[str, Any]:
    """The peer on `prompts`, prompt j being request `first_request + j` of the run (its
    seed: the run's seed + that index)."""
    from multiserve.bench.peer import run_peer

    bs = 1 if stream else options.peer_batch_size
    temperature, seed = _sampling(options)
    return run_peer(options.peer, prompts, m, model, batch_size=bs,
                    threads=options.peer_threads, stream=stream,
                    show_progress=show, temperature=temperature, seed=seed + first_request,
                    dtype=options.peer_dtype)


def _interleaved(options: BenchOptions) -> bool:
    """Single stream: the peer's rounds alternate with ours (`--interleave`; by default
    where a peer process starts in well under a second: llama.cpp, whose weights are
    mmap'd), else they follow ours."""
    chosen = options.interleave
    return options.peer == "llamacpp" if chosen is None else bool(chosen)


def _sampling(options: BenchOptions) -> tuple[float, int]:
    """(temperature, base seed) of the run: request i samples at the temperature with
    seed base + i (0: greedy)."""
    return float(options.temperature), int(options.seed)


def _check_sampling(options: BenchOptions, n: int) -> None:
    """Fail before compiling on a temperature or seed a request would refuse."""
    from multiserve.bench.ours import request_params
    from multiserve.types import SamplingParamsError

    temperature, seed = _sampling(options)
    try:
        request_params(1, temperature, seed, 0)
        request_params(1, temperature, seed, n - 1)
    except SamplingParamsError as e:
        raise SystemExit(f"bench: invalid sampling flag: {e}") from None


def peer_agreement(ours: list[list[int]], theirs: list[list[int]], temperature: float
                   ) -> tuple[dict[str, float] | None, str | None]:
    """How far the outputs agree, or (None, why not) when it means nothing."""
    if temperature > 0:
        return None, (f"temperature {temperature:g} > 0: sampled outputs of two engines "
                      "come from different random streams and are not expected to agree")
    return agreement(ours, theirs), None


def _check_peer_env(options: BenchOptions) -> None:
    """Fail before compiling when the peer's environment is missing."""
    from multiserve.bench.peer import PeerError, peer_python, peer_script

    try:
        peer_script(options.peer)
        peer_python(options.peer)
    except PeerError as e:
        raise SystemExit(f"bench: {e}") from None


def _start(cfg: Any) -> tuple[Any, float, dict[str, Any]]:
    from multiserve.engine.engine import Engine

    t_start = time.perf_counter()
    engine = Engine(cfg)
    startup_s = time.perf_counter() - t_start  # to serving (the covering buckets compiled)
    engine.wait_compiled()  # measure with every bucket, as a long-running server has
    all_compiled_s = time.perf_counter() - t_start
    info = {**engine.call(StepInfo()).result(), "all_compiled_s": all_compiled_s}
    return engine, startup_s, info


def bench_main(options: BenchOptions) -> int:
    if options.lora_adapters != 0:
        from multiserve.bench.lora_bench import check_lora_options

        check_lora_options(options)
    if options.agent_sessions:
        from multiserve.bench.agent_bench import agent_main

        return agent_main(options)
    if options.fleet:
        from multiserve.bench.fleet_bench import fleet_main

        if _sampling(options)[0] > 0:
            raise SystemExit("bench: --temperature applies to the batch and single-stream "
                             "modes; --fleet compares greedy outputs")
        return fleet_main(options)
    if options.duration is not None:
        raise SystemExit("bench: --duration is the sustained load of --fleet")
    if options.random_model is not None:
        if options.model is not None:
            raise SystemExit("bench: --random-model and --model name two models; give one")
        from multiserve.bench.random_model import cached_random_model

        options = replace(options, model=str(cached_random_model(options.random_model)))
    single = options.single_stream
    if options.output_len is None:
        options = replace(options, output_len=SINGLE_STREAM_LEN if single else BATCH_LEN)
    n, m, rounds = options.num_prompts, int(options.output_len), options.rounds
    if n < 1 or m < 1 or rounds < 1:
        raise SystemExit("bench: --num-prompts, --output-len and --rounds must be >= 1")
    _check_sampling(options, rounds if single else n)
    cfg = _engine_config(options)
    if options.lora_adapters:
        from multiserve.bench.lora_bench import lora_main

        return lora_main(options, cfg, _start)
    peer_model = None
    if options.peer != "none":  # fail before compiling
        options = replace(options, peer_dtype=_peer_dtype(cfg))
        peer_model = _peer_model(options)
        _check_peer_env(options)
    if options.ab_speculation:
        from multiserve.bench.spec_bench import spec_main

        if options.peer != "none" and not single:
            raise SystemExit("bench: --ab-speculation compares with a peer in --single-stream")
        run_peer = None
        if peer_model is not None:
            def run_peer(ids: list[int]) -> dict[str, Any]:
                return _run_peer(options, peer_model, [ids], int(options.output_len),
                                 stream=True, show=not options.no_progress)
        return spec_main(options, cfg, _start, run_peer)
    if options.workload != "chat":
        raise SystemExit("bench: --workload grounded|grpo is a workload of --ab-speculation")
    if single:
        return _single_main(options, cfg, peer_model)
    return _batch_main(options, cfg, peer_model)


def _batch_main(options: BenchOptions, cfg: Any, peer_model: str | None) -> int:
    from multiserve.bench.ours import run_once

    n, m = options.num_prompts, int(options.output_len)
    show = not options.no_progress
    temperature, seed = _sampling(options)
    engine, startup_s, info = _start(cfg)
    try:
        prompts = [engine.chat_ids([{"role": "user", "content": text}])
                   for text in bench_prompts(n)]
        primary = not cfg.disable_overlap
        sampling = {"temperature": temperature, "seed": seed}
        run_once(engine, prompts[:4], min(m, 4), overlap=primary, desc="warmup",
                 show_progress=False, **sampling)
        if options.host_phases:
            set_host_phases(engine, True)
        runs = {"ours": run_once(engine, prompts, m, overlap=primary,
                                 desc=f"overlap={'on' if primary else 'off'}",
                                 show_progress=show, **sampling)}
        host_phases = set_host_phases(engine, False) if options.host_phases else None
        if options.ab_overlap:
            runs["ours_ab"] = run_once(engine, prompts, m, overlap=not primary,
                                       desc=f"overlap={'off' if primary else 'on'}",
                                       show_progress=show, **sampling)
        final_state = engine.get_internal_state()
        peak_rss_mb = _peak_rss_mb()
        device = f"{engine.devices[0].platform}:{cfg.device_indexes}"
        model_name = engine.model_name
        breakdown = None  # after the measured runs, on the same engine: they are done
        if not options.no_breakdown:
            breakdown = _breakdown(engine, prompts, m, runs["ours"], sampling)
    finally:
        engine.shutdown()

    peer = None
    if peer_model is not None:
        peer = _run_peer(options, peer_model, prompts, m, stream=False, show=show)
    result = _result(options, cfg, info, prompts, runs, peer, startup_s, peak_rss_mb,
                     final_state, device, model_name)
    result["breakdown"] = breakdown
    result["host_phases"] = host_phases
    print("\n".join(batch_report(result)), file=sys.stdout)
    print(json.dumps(result), flush=True)
    return 0


def set_host_phases(engine: Any, on: bool) -> dict[str, Any] | None:
    """On the engine thread: start timing the host phases of every step pass
    (engine/host_phases.py), or stop and return their summary."""
    from multiserve.engine.commands import Call
    from multiserve.engine.host_phases import HostPhases

    def switch(core: Any) -> dict[str, Any] | None:
        phases, core.host_phases = core.host_phases, HostPhases() if on else None
        return None if on or phases is None else phases.summary()

    return engine.call(Call(switch)).result()


def _breakdown(engine: Any, prompts: list[list[int]], m: int, run: dict[str, Any],
               sampling: dict[str, Any]) -> dict[str, Any]:
    """The step-time breakdown of `run` (breakdown.py), or {"error": why}: a diagnostic
    that fails must not throw away the measured runs."""
    from multiserve.bench.breakdown import step_breakdown

    try:
        return step_breakdown(engine, prompts, m, run, **sampling)
    except Exception as e:  # noqa: BLE001 - reported in the JSON and the table
        return {"error": f"{type(e).__name__}: {e}"}


def _single_main(options: BenchOptions, cfg: Any, peer_model: str | None) -> int:
    from multiserve.bench.single import (
        merge_peer_rounds,
        single_result,
        stream_once,
        stream_rounds,
    )

    m, rounds = int(options.output_len), options.rounds
    show = not options.no_progress
    temperature, seed = _sampling(options)
    interleave = peer_model is not None and _interleaved(options)
    peer_rounds: list[dict[str, Any]] = []
    engine, startup_s, info = _start(cfg)
    try:
        ids = engine.chat_ids([{"role": "user", "content": bench_prompts(1)[0]}])
        stream_once(engine, ids, min(m, 4), rid="bench-single-warmup",
                    temperature=temperature, seed=seed)

        def peer_round(i: int) -> None:  # the peer's round i, between ours i and i + 1
            assert peer_model is not None
            peer_rounds.append(_run_peer(options, peer_model, [ids], m, stream=True,
                                         show=show, first_request=i))

        ours = stream_rounds(engine, ids, m, rounds, rid="bench-single",
                             temperature=temperature, seed=seed,
                             after_round=peer_round if interleave else None)
        base = {"bench": "multiserve", "model": engine.model_name,
                "device": f"{engine.devices[0].platform}:{cfg.device_indexes}",
                "dtype": info["dtype"], "output_len": m,
                "temperature": temperature, "seed": seed,
                "prompt_tokens": {"total": len(ids), "min": len(ids), "max": len(ids),
                                  "mean": float(len(ids))},
                "startup_s": startup_s, "compile_s": info["compile_s"],
                "all_compiled_s": info["all_compiled_s"],
                "peak_rss_mb": _peak_rss_mb(),
                "cache_miss_count": engine.get_internal_state()["cache_miss_count"]}
    finally:
        engine.shutdown()
    peer = agree = why = None
    if peer_model is not None:
        peer = (merge_peer_rounds(peer_rounds) if interleave else
                _run_peer(options, peer_model, [ids] * rounds, m, stream=True, show=show))
        agree, why = peer_agreement(ours["output_ids"], peer["output_ids"], temperature)
    result = single_result(base, ours, peer, agree)
    if why is not None:
        result["peer_agreement_note"] = why
    print("\n".join(single_report(result)), file=sys.stdout)
    print(json.dumps(result), flush=True)
    return 0


def _result(options: BenchOptions, cfg: Any, info: dict[str, Any],
            prompts: list[list[int]], runs: dict[str, dict[str, Any]],
            peer: dict[str, Any] | None, startup_s: float, peak_rss_mb: float,
            state: dict[str, Any], device: str, model_name: str) -> dict[str, Any]:
    lens = [len(p) for p in prompts]
    ours = runs["ours"]
    res: dict[str, Any] = {
        "bench": "multiserve",
        "mode": "batch",
        "model": model_name,
        "device": device,
        "dtype": info["dtype"],
        "num_prompts": len(prompts),
        "output_len": int(options.output_len),
        "temperature": _sampling(options)[0],
        "seed": _sampling(options)[1],
        "prompt_tokens": {"total": sum(lens), "min": min(lens), "max": max(lens),
                          "mean": sum(lens) / len(lens)},
        "config": {"max_running_requests": cfg.max_running_requests,
                   "precompile_bs_paddings": list(cfg.precompile_bs_paddings),
                   "precompile_token_paddings": list(cfg.precompile_token_paddings),
                   "chunked_prefill_size": cfg.chunked_prefill_size,
                   "page_size": cfg.page_size, "num_buckets": len(info["buckets"])},
        "startup_s": startup_s,
        "compile_s": info["compile_s"],
        "all_compiled_s": info["all_compiled_s"],
        "peak_rss_mb": peak_rss_mb,
        "cache_miss_count": state["cache_miss_count"],
        "ours": without_output_ids(ours),
        "tokens_per_s": ours["tokens_per_s"],
    }
    overlap_ratio = None
    if "ours_ab" in runs:
        ab = runs["ours_ab"]
        on, off = (ours, ab) if ours["overlap"] else (ab, ours)
        overlap_ratio = on["tokens_per_s"] / off["tokens_per_s"]
        res["ours_ab"] = without_output_ids(ab)
        res["overlap_outputs_identical"] = on["output_ids"] == off["output_ids"]
    res["overlap_ratio"] = overlap_ratio
    ratio = None
    if peer is not None:
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        agree, why = peer_agreement(ours["output_ids"], peer["output_ids"],
                                    _sampling(options)[0])
        res["peer_agreement"] = agree
        if why is not None:
            res["peer_agreement_note"] = why
        res["peer"] = without_output_ids(peer)
    res["ratio_vs_peer"] = ratio
    res["targets"] = {
        "vs_peer": TARGET_VS_PEER, "vs_peer_met": None if ratio is None
        else ratio >= TARGET_VS_PEER,
        "overlap": TARGET_OVERLAP, "overlap_met": None if overlap_ratio is None
        else overlap_ratio >= TARGET_OVERLAP,
        "zero_recompiles_met": state["cache_miss_count"] == 0,
    }
    return res
