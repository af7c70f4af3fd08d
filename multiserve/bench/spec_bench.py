"""`multiserve bench --ab-speculation`: speculative decoding on and off in ONE run, on one
engine (the same compiled programs and KV pool; only speculation is switched between
runs, by the engine command SetSpeculation, each "on" run drafting afresh), every program
compiled first.

Workloads (`--workload`):
- `chat`: the batch benchmark's prompt list (prompts.py), N x M, greedy by default;
- `grounded`: copy / rewrite / extract from a passage in the prompt, edit a code snippet
  (grounded_prompts.py), where prompt-lookup drafts pay;
- `grpo`: `--num-prompts` P prompts x `--group-size` G samples at temperature 1 (request i
  seeded), two epochs of the same prompts with other seeds: the second epoch drafts from
  the first's outputs (engine/spec/group_store.py); reported per epoch.
`--single-stream` runs one grounded or chat prompt streamed (TTFT, tok/s) instead, with a
`--peer` in the same run if asked (llama.cpp: the F32 GGUF). Every on/off pair must give
the same output ids (the engine's promise): the JSON says whether they did.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from multiserve.bench.grounded_prompts import grounded_prompts
from multiserve.bench.options import BenchOptions
from multiserve.bench.prompts import bench_prompts
from multiserve.bench.stats import without_output_ids
from multiserve.engine.commands import SetSpeculation

TARGET_GROUNDED_SINGLE = 2.0  # issue 32: grounded single stream >= 2x speculation off
TARGET_VS_LLAMACPP = 1.5  # ... and >= 1.5x llama.cpp F32
TARGET_GRPO_EPOCH = 1.3  # GRPO second epoch >= 1.3x the first
TARGET_CHAT_BATCH = 0.98  # 64 x 128 chat batch >= 0.98x speculation off


def set_speculation(engine: Any, on: bool) -> None:
    """Switch the engine's speculative decoding: a fresh n-gram drafter, or none (between
    runs: the engine is idle)."""
    engine.call(SetSpeculation(on)).result()


def _texts(options: BenchOptions, n: int) -> list[str]:
    return grounded_prompts(n) if options.workload == "grounded" else bench_prompts(n)


def spec_main(options: BenchOptions, cfg: Any,
              start: Callable[[Any], tuple[Any, float, dict[str, Any]]],
              run_peer: Callable[[list[int]], dict[str, Any]] | None) -> int:
    """The run: `start(cfg)` builds the engine with every program compiled (bench/run.py's);
    `run_peer(ids)`, when a peer is asked for, streams the same prompt through it."""
    engine, startup_s, info = start(cfg)
    try:
        base = {"bench": "multiserve", "mode": "speculation", "workload": options.workload,
                "model": engine.model_name, "dtype": info["dtype"], "startup_s": startup_s,
                "all_compiled_s": info["all_compiled_s"],
                "speculative_num_draft_tokens": cfg.speculative_num_draft_tokens,
                "speculative_max_step_tokens": cfg.speculative_max_step_tokens}
        if options.single_stream:
            result, ids = _single(options, engine)
        elif options.workload == "grpo":
            result, ids = _grpo(options, engine), None
        else:
            result, ids = _batch(options, engine), None
        state = engine.get_internal_state()
        result["cache_miss_count"] = state["cache_miss_count"]
    finally:
        engine.shutdown()
    if options.single_stream and run_peer is not None:
        peer = run_peer(ids)
        result["peer"] = without_output_ids(peer)
        result["peer_identical"] = peer["output_ids"] == [result.pop("_on_ids")]
        on = result["on"]["tokens_per_s"]
        result["ratio_vs_peer"] = on / peer["tokens_per_s"] if peer["tokens_per_s"] else None
    result.pop("_on_ids", None)
    result = {**base, **result}
    print("\n".join(spec_report(result)))
    print(json.dumps(result), flush=True)
    return 0


def _ab(run: Any, engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(off, on): speculation off, then on, each run cold (prefix cache flushed)."""
    set_speculation(engine, False)
    off = run("off")
    set_speculation(engine, True)
    on = run("on")
    return off, on


def _batch(options: BenchOptions, engine: Any) -> dict[str, Any]:
    from multiserve.bench.ours import run_once

    n, m = int(options.num_prompts), int(options.output_len)
    temperature, seed = float(options.temperature), int(options.seed)
    prompts = [engine.chat_ids([{"role": "user", "content": t}]) for t in _texts(options, n)]
    show = not options.no_progress
    set_speculation(engine, True)  # warm-up with drafts: the bucket costs get measured
    run_once(engine, prompts[:4], min(m, 16), overlap=True, desc="warmup",
             show_progress=False, temperature=temperature, seed=seed)

    def run(tag: str) -> dict[str, Any]:
        return run_once(engine, prompts, m, overlap=True, desc=f"spec-{tag}",
                        show_progress=show, temperature=temperature, seed=seed)

    off, on = _ab(run, engine)
    return {"num_prompts": n, "output_len": m, "temperature": temperature, "seed": seed,
            "off": without_output_ids(off), "on": without_output_ids(on),
            "ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "outputs_identical": on["output_ids"] == off["output_ids"],
            "target": TARGET_CHAT_BATCH if options.workload == "chat" else None}


def _single(options: BenchOptions, engine: Any) -> tuple[dict[str, Any], list[int]]:
    from multiserve.bench.single import stream_once

    m = int(options.output_len)
    temperature, seed = float(options.temperature), int(options.seed)
    ids = engine.chat_ids([{"role": "user", "content": _texts(options, 1)[0]}])
    set_speculation(engine, True)
    stream_once(engine, ids, min(m, 16), rid="spec-warmup", temperature=temperature,
                seed=seed)

    def run(tag: str) -> dict[str, Any]:
        return stream_once(engine, ids, m, rid=f"spec-single-{tag}", temperature=temperature,
                           seed=seed)

    off, on = _ab(run, engine)
    return ({"num_prompts": 1, "output_len": m, "temperature": temperature, "seed": seed,
             "single_stream": True, "prompt_tokens": len(ids),
             "off": without_output_ids(off), "on": without_output_ids(on),
             "ratio": on["tokens_per_s"] / off["tokens_per_s"],
             "outputs_identical": on["output_ids"] == off["output_ids"],
             "_on_ids": on["output_ids"][0],
             "target": TARGET_GROUNDED_SINGLE if options.workload == "grounded" else None},
            ids)


def _grpo(options: BenchOptions, engine: Any) -> dict[str, Any]:
    """P prompts x G samples, two epochs (seeds seed + i, then seed + 10000 + i), with
    speculation off and on: each side's epoch 2 vs its epoch 1."""
    from multiserve.bench.ours import run_once

    p, g, m = int(options.num_prompts), int(options.group_size), int(options.output_len)
    temperature = float(options.temperature) if options.temperature else 1.0
    texts = bench_prompts(p)
    prompts = [engine.chat_ids([{"role": "user", "content": t}]) for t in texts
               for _ in range(g)]
    show = not options.no_progress
    set_speculation(engine, True)
    run_once(engine, prompts[:4], min(m, 16), overlap=True, desc="warmup",
             show_progress=False, temperature=temperature, seed=int(options.seed) + 99_999)
    out: dict[str, Any] = {"num_prompts": p, "group_size": g, "output_len": m,
                           "temperature": temperature, "seed": int(options.seed)}
    epochs: dict[str, list[dict[str, Any]]] = {}
    for side in ("off", "on"):
        set_speculation(engine, side == "on")  # a fresh drafter: no memory of other runs
        epochs[side] = [run_once(engine, prompts, m, overlap=True,
                                 desc=f"grpo-{side}-epoch{e + 1}", show_progress=show,
                                 temperature=temperature, seed=int(options.seed) + 10_000 * e)
                        for e in range(2)]
    for side, runs in epochs.items():
        out[side] = {f"epoch{e + 1}": without_output_ids(r) for e, r in enumerate(runs)}
        out[side]["epoch2_vs_epoch1"] = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    out["outputs_identical"] = all(a["output_ids"] == b["output_ids"]
                                   for a, b in zip(epochs["off"], epochs["on"], strict=True))
    out["ratio"] = epochs["on"][1]["tokens_per_s"] / epochs["off"][1]["tokens_per_s"]
    out["target"] = TARGET_GRPO_EPOCH
    return out


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def spec_report(res: dict[str, Any]) -> list[str]:
    """The human-readable table of a speculation run."""
    def row(name: str, r: dict[str, Any]) -> str:
        return (f"  {name:18} {r['tokens_per_s']:8.1f} tok/s   acceptance "
                f"{_fmt(r.get('spec_acceptance'), '.2f'):>5}   accepted length "
                f"{_fmt(r.get('spec_accept_length'), '.2f'):>5}   verify rows "
                f"{r.get('spec_verify_ct', 0)}")

    lines = [f"speculation: workload {res['workload']}, model {res['model']}, "
             f"dtype {res['dtype']}, draft tokens <= {res['speculative_num_draft_tokens']}"]
    if res["workload"] == "grpo" and not res.get("single_stream"):
        lines.append(f"  {res['num_prompts']} prompts x {res['group_size']} samples x "
                     f"{res['output_len']} tokens, temperature {res['temperature']:g}")
        for side in ("off", "on"):
            for e in ("epoch1", "epoch2"):
                lines.append(row(f"{side} {e}", res[side][e]))
            lines.append(f"  {side}: epoch 2 / epoch 1 = {res[side]['epoch2_vs_epoch1']:.2f}x"
                         + (f" (target >= {res['target']}x)" if side == "on" else ""))
    else:
        lines.append(f"  {res['num_prompts']} x {res['output_len']} tokens"
                     + (" streamed" if res.get("single_stream") else ""))
        lines.append(row("speculation off", res["off"]))
        lines.append(row("speculation on", res["on"]))
        target = res.get("target")
        lines.append(f"  on / off = {res['ratio']:.2f}x"
                     + (f" (target >= {target}x)" if target else ""))
        if "peer" in res:
            lines.append(f"  peer {res['peer'].get('peer', '')}: "
                         f"{res['peer']['tokens_per_s']:.1f} tok/s; on / peer = "
                         f"{_fmt(res.get('ratio_vs_peer'), '.2f')}x; identical output: "
                         f"{res.get('peer_identical')}")
    lines.append(f"  outputs identical with and without speculation: "
                 f"{res['outputs_identical']}; recompiles after warm-up: "
                 f"{res['cache_miss_count']}")
    return lines


__all__ = ["set_speculation", "spec_main", "spec_report"]
