"""`multiserve bench`: offline throughput of one Engine on the default model, optionally
against a peer (Hugging Face transformers, in a subprocess) in the same run.

What is measured (see ours.py for how one run goes):
- start-up: Engine construction (load + compile every bucket), reported apart;
- a short warm-up run (excluded), then the measured run(s): N prompts from the fixed
  list (prompts.py), chat-templated, all submitted at once, greedy, ignore_eos,
  exactly M output tokens each;
- tokens/s (output tokens / wall), TTFT p50/p99, ITL p50/p99, steps, peak RSS,
  recompiles after warm-up (`cache_miss_count`, must stay 0);
- `--ab-overlap`: the same prompts with overlap scheduling on and off (ratio on/off,
  and whether greedy outputs are identical, as they must be);
- `--peer hf`: the same token ids through transformers `generate`; ratio ours/peer
  and how far the two greedy outputs agree.
Ends with ONE JSON line on stdout holding every figure (progress bars go to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from multiserve.bench.prompts import bench_prompts
from multiserve.bench.stats import agreement
from multiserve.bench.stats import peak_rss_mb as _peak_rss_mb

TARGET_VS_PEER = 2.0
TARGET_OVERLAP = 1.1


def _engine_config(args: argparse.Namespace) -> Any:
    """The default EngineConfig, changed only where a flag says so (errors name the
    field: ConfigError)."""
    from multiserve.config import EngineConfig

    base = EngineConfig()
    changes: dict[str, Any] = {"model_path": args.model,
                               "disable_overlap": bool(args.no_overlap),
                               "show_progress": not getattr(args, "no_progress", False)}
    for flag, name in (("token_paddings", "precompile_token_paddings"),
                       ("bs_paddings", "precompile_bs_paddings"),
                       ("chunked_prefill_size", "chunked_prefill_size"),
                       ("max_total_tokens", "max_total_tokens")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[name] = tuple(value) if isinstance(value, list) else value
    bs = changes.get("precompile_bs_paddings", base.precompile_bs_paddings)
    if args.max_running is not None:
        changes["max_running_requests"] = args.max_running
        if args.max_running > max(bs):
            changes["precompile_bs_paddings"] = tuple(bs) + (args.max_running,)
    elif max(bs) < base.max_running_requests:
        changes["max_running_requests"] = max(bs)
    if "chunked_prefill_size" not in changes:
        tokens = changes.get("precompile_token_paddings", base.precompile_token_paddings)
        changes["chunked_prefill_size"] = min(base.chunked_prefill_size, max(tokens))
    return base.with_updates(**changes)


def _peer_model_dir(args: argparse.Namespace) -> str:
    if args.model is None:
        from multiserve.model.default_model import default_model_path

        return str(default_model_path())
    if Path(args.model, "config.json").is_file():
        return str(args.model)
    raise SystemExit("bench: --peer hf needs a Hugging Face model directory "
                     f"(config.json + safetensors); got {args.model!r}")


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "output_ids"}


def bench_main(args: argparse.Namespace) -> int:
    n, m = int(args.num_prompts), int(args.output_len)
    if n < 1 or m < 1:
        raise SystemExit("bench: --num-prompts and --output-len must be >= 1")
    show = not getattr(args, "no_progress", False)
    cfg = _engine_config(args)
    peer_dir = _peer_model_dir(args) if args.peer != "none" else None  # fail before compiling

    from multiserve.bench.ours import run_once
    from multiserve.engine.engine import Engine

    t_start = time.perf_counter()
    engine = Engine(cfg)
    startup_s = time.perf_counter() - t_start
    try:
        info = engine.run_on_engine_thread(lambda core: {
            "dtype": str(core.runner.dtype), "compile_s": core.runner.warmup_seconds,
            "buckets": core.runner.buckets()})
        prompts = [engine.chat_ids([{"role": "user", "content": text}])
                   for text in bench_prompts(n)]
        primary = not cfg.disable_overlap
        run_once(engine, prompts[:4], min(m, 4), overlap=primary, desc="warmup",
                 show_progress=False)
        runs = {"ours": run_once(engine, prompts, m, overlap=primary,
                                 desc=f"overlap={'on' if primary else 'off'}",
                                 show_progress=show)}
        if args.ab_overlap:
            runs["ours_ab"] = run_once(engine, prompts, m, overlap=not primary,
                                       desc=f"overlap={'off' if primary else 'on'}",
                                       show_progress=show)
        final_state = engine.get_internal_state()
        peak_rss_mb = _peak_rss_mb()
        device = f"{engine.devices[0].platform}:{cfg.device_indexes}"
        model_name = engine.model_name
    finally:
        engine.shutdown()

    peer = None
    if args.peer != "none":
        from multiserve.bench.peer import run_peer

        assert peer_dir is not None
        peer = run_peer(args.peer, prompts, m, peer_dir,
                        batch_size=getattr(args, "peer_batch_size", 0) or 0,
                        threads=getattr(args, "peer_threads", None), show_progress=show)

    result = _result(args, cfg, info, prompts, runs, peer, startup_s, peak_rss_mb,
                     final_state, device, model_name)
    _print_report(result)
    print(json.dumps(result), flush=True)
    return 0


def _result(args: argparse.Namespace, cfg: Any, info: dict[str, Any],
            prompts: list[list[int]], runs: dict[str, dict[str, Any]],
            peer: dict[str, Any] | None, startup_s: float, peak_rss_mb: float,
            state: dict[str, Any], device: str, model_name: str) -> dict[str, Any]:
    lens = [len(p) for p in prompts]
    ours = runs["ours"]
    res: dict[str, Any] = {
        "bench": "multiserve",
        "model": model_name,
        "device": device,
        "dtype": info["dtype"],
        "num_prompts": len(prompts),
        "output_len": int(args.output_len),
        "prompt_tokens": {"total": sum(lens), "min": min(lens), "max": max(lens),
                          "mean": sum(lens) / len(lens)},
        "config": {"max_running_requests": cfg.max_running_requests,
                   "precompile_bs_paddings": list(cfg.precompile_bs_paddings),
                   "precompile_token_paddings": list(cfg.precompile_token_paddings),
                   "chunked_prefill_size": cfg.chunked_prefill_size,
                   "page_size": cfg.page_size, "num_buckets": len(info["buckets"])},
        "startup_s": startup_s,
        "compile_s": info["compile_s"],
        "peak_rss_mb": peak_rss_mb,
        "cache_miss_count": state["cache_miss_count"],
        "ours": _strip(ours),
        "tokens_per_s": ours["tokens_per_s"],
    }
    overlap_ratio = None
    if "ours_ab" in runs:
        ab = runs["ours_ab"]
        on, off = (ours, ab) if ours["overlap"] else (ab, ours)
        overlap_ratio = on["tokens_per_s"] / off["tokens_per_s"]
        res["ours_ab"] = _strip(ab)
        res["overlap_outputs_identical"] = on["output_ids"] == off["output_ids"]
    res["overlap_ratio"] = overlap_ratio
    ratio = None
    if peer is not None:
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        res["peer_agreement"] = agreement(ours["output_ids"], peer["output_ids"])
        res["peer"] = {k: v for k, v in peer.items() if k != "output_ids"}
    res["ratio_vs_peer"] = ratio
    res["targets"] = {
        "vs_peer": TARGET_VS_PEER, "vs_peer_met": None if ratio is None
        else ratio >= TARGET_VS_PEER,
        "overlap": TARGET_OVERLAP, "overlap_met": None if overlap_ratio is None
        else overlap_ratio >= TARGET_OVERLAP,
        "zero_recompiles_met": state["cache_miss_count"] == 0,
    }
    return res


def _row(name: str, r: dict[str, Any]) -> str:
    ms = 1000.0
    return (f"{name:<18}{r['tokens_per_s']:>9.1f}{r['wall_s']:>9.2f}"
            f"{r['ttft_p50_s'] * ms:>10.0f}{r['ttft_p99_s'] * ms:>10.0f}"
            f"{r['itl_p50_s'] * ms:>9.1f}{r['itl_p99_s'] * ms:>9.1f}")


def _print_report(res: dict[str, Any]) -> None:
    p = res["prompt_tokens"]
    c = res["config"]
    out = sys.stdout
    print(f"\nmultiserve bench — {res['model']} on {res['device']} ({res['dtype']})", file=out)
    print(f"{res['num_prompts']} prompts (prompt tokens: total {p['total']}, min {p['min']}, "
          f"mean {p['mean']:.0f}, max {p['max']}) x {res['output_len']} output tokens, "
          "greedy, ignore_eos, all submitted at once", file=out)
    print(f"engine: max_running_requests={c['max_running_requests']} "
          f"bs_paddings={c['precompile_bs_paddings']} "
          f"token_paddings={c['precompile_token_paddings']} "
          f"chunked_prefill={c['chunked_prefill_size']} page_size={c['page_size']}", file=out)
    print(f"start-up {res['startup_s']:.1f} s (compile {c['num_buckets']} buckets: "
          f"{res['compile_s']:.1f} s); peak RSS {res['peak_rss_mb']:.0f} MiB", file=out)
    print(f"{'':<18}{'tok/s':>9}{'wall s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}   (latencies in ms)", file=out)
    for key in ("ours", "ours_ab"):
        if key in res:
            r = res[key]
            label = f"ours overlap={'on' if r['overlap'] else 'off'}"
            print(_row(label, r) + f"   {r['steps']} steps, {r['mean_step_ms']:.0f} ms/step",
                  file=out)
    if "peer" in res:
        peer = res["peer"]
        print(_row(f"peer {peer['peer']}", peer) + f"   batch {peer['batch_size']}, "
              f"{peer['threads']} threads, RSS {peer['peak_rss_mb']:.0f} MiB", file=out)
        a = res["peer_agreement"]
        print(f"ours / peer: {res['ratio_vs_peer']:.2f}x (target >= {TARGET_VS_PEER}x); "
              f"greedy outputs identical for {a['identical_fraction']:.0%}, mean common "
              f"prefix {a['mean_common_prefix']:.1f} tokens", file=out)
    if res["overlap_ratio"] is not None:
        print(f"overlap on / off: {res['overlap_ratio']:.2f}x (target >= {TARGET_OVERLAP}x); "
              f"outputs identical: {res['overlap_outputs_identical']}", file=out)
    print(f"recompiles after warm-up (cache_miss_count): {res['cache_miss_count']}", file=out)
