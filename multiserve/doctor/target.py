"""`multiserve doctor --target cuda|tpu`: what an engine would run on that accelerator,
checked here without one. For (a) the model `--model` names (default: the embedded default
model, SmolLM2-135M) and (b) the ~1B-shaped random bfloat16 model (bench/random_model.py),
it prints the attention kernel and the product formulations the target starts from
(model/target_export.py: `target_plan`) and lowers, with `jax.export` for that platform, the
whole model forward (model/families/forward.py) of a decode step and of the largest mixed
step, and the engine's own FORWARD, FUSED and DECODE_STEPS step programs of a decode step
(DECODE_STEPS: `DECODE_STEPS` decode steps of the fused step in one loop; doctor/steps.py).
A lowering that fails is printed with its error, never raised."""

from __future__ import annotations

import argparse
import json
from typing import Any

TARGETS = ("cuda", "tpu")
DEVICE_PLATFORM = {"cuda": "gpu", "tpu": "tpu"}  # jax.export platform -> jax device platform
DECODE_ROWS = 16
# the DECODE_STEPS program's K (EngineConfig.decode_steps_per_dispatch; any K > 1 lowers
# the same loop body, only its trip count differs)
DECODE_STEPS = 4
NUM_PAGES = 4096  # the abstract pool's pages (any count lowers the same program shape)
# a program's name in the report (doctor/steps.py KINDS -> programs.ProgramKind's names)
PROGRAM_NAMES = {"forward": "FORWARD", "fused": "FUSED", "steps": "DECODE_STEPS"}


def _model_report(label: str, cfg: Any, dtype: str, target: str) -> dict[str, Any]:
    """The plan and the lowered forwards of one model config on `target`."""
    from multiserve.config import EngineConfig
    from multiserve.doctor.steps import export_step_programs
    from multiserve.model.invariance.workload import default_workload
    from multiserve.model.layers.attention_pallas import pinned_blocks
    from multiserve.model.target_export import export_forward, target_plan

    ec = EngineConfig()
    workload = default_workload(cfg, dtype)
    plan = target_plan(workload, target, cfg.tie_word_embeddings)
    max_pages = -(-(ec.max_context_len or cfg.max_position_embeddings) // ec.page_size)
    # a 16-row decode step, and the largest mixed step (prefill chunks and decode rows)
    steps = [(DECODE_ROWS, DECODE_ROWS),
             (max(ec.precompile_token_paddings), max(ec.precompile_bs_paddings))]
    exports = [export_forward(cfg, dtype, target, plan, tokens=t, rows=r,
                              page_size=ec.page_size, block_size=ec.attention_block_size,
                              max_pages=max_pages, num_pages=NUM_PAGES) for t, r in steps]
    programs = export_step_programs(cfg, dtype, target, plan, ec, forward_tokens=DECODE_ROWS,
                                    fused_rows=DECODE_ROWS, max_pages=max_pages,
                                    num_pages=NUM_PAGES, decode_steps=DECODE_STEPS)
    per_block, per_split = pinned_blocks(ec.page_size)
    return {
        "model": label, "dtype": dtype,
        "shape": {"layers": cfg.num_layers, "hidden": cfg.hidden_size,
                  "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "vocab": cfg.vocab_size},
        "attention": {"kernel": plan.attention.kernel, "page_size": ec.page_size,
                      "pages_per_compute_block": per_block,
                      **({"pages_per_split": per_split} if target == "cuda" else {})},
        "products": [{"name": p.name, "shape": f"{p.k}x{p.n}",
                      "formulations": sorted({f.kernel for _, f in p.by_rows})}
                     for p in plan.products],
        "problems": list(plan.problems),
        "exports": [_export_json(f"model forward T={e.tokens} R={e.rows}", e)
                    for e in exports] + [
            _export_json(f"engine {PROGRAM_NAMES[name]} program of {e.tokens} tokens, "
                         f"{e.rows} rows" + (f", {DECODE_STEPS} decode steps"
                                             if name == "steps" else ""), e)
            for name, e in programs.items()],
    }


def _export_json(what: str, e: Any) -> dict[str, Any]:
    return {"what": what, "tokens": e.tokens, "rows": e.rows, "scanned": e.scanned,
            "lowered": e.error is None, "mlir_chars": e.mlir_chars,
            "pallas_calls": e.pallas_calls, "error": e.error}


def _print_report(rep: dict[str, Any], target: str) -> None:
    s = rep["shape"]
    print(f"\n== {rep['model']}, {rep['dtype']}: {s['layers']} layers, hidden {s['hidden']}, "
          f"{s['heads']} heads / {s['kv_heads']} KV of {s['head_dim']}, vocab {s['vocab']}")
    if "dtype_reason" in rep:
        print(f"dtype: {rep['dtype_reason']}")
    att = rep["attention"]
    print(f"attention kernel: {att['kernel']} (model/layers/attention_pallas.py), pinned: "
          + ", ".join(f"{k} {v}" for k, v in att.items() if k != "kernel"))
    for p in rep["products"]:
        print(f"product {p['name']:10} {p['shape']:>12}: {'/'.join(p['formulations'])}")
    for problem in rep["problems"]:
        print(f"  note: {problem}")
    for e in rep["exports"]:
        what = f"{e['what']} ({'scanned' if e['scanned'] else 'unrolled'} decoder)"
        if e["lowered"]:
            print(f"{what}: lowered for {target}, {e['mlir_chars']} chars of StableHLO, "
                  f"{e['pallas_calls']} Pallas kernel call site(s)")
        else:
            print(f"{what}: FAILED to lower for {target}: {e['error'].splitlines()[0][:600]}")


def target_report(target: str, model: str | None, dtype: str) -> dict[str, Any]:
    """The report of `doctor --target` (what `--json` prints): both models on `target`,
    "lowered" False if any program failed to lower."""
    import jax

    from multiserve.bench.random_model import SIZES
    from multiserve.engine.base.dtype_choice import choose_dtype
    from multiserve.model.loading.hf import load_hf_config
    from multiserve.model.loading.loader import resolve_model_dir

    model_dir = resolve_model_dir(model)
    choice = choose_dtype(dtype, DEVICE_PLATFORM[target],
                          None if model is None else model_dir, None, None)
    reports = [
        _model_report(model or "the default model (SmolLM2-135M)",
                      load_hf_config(model_dir), choice.dtype, target),
        _model_report("random 1B shape (bench/random_model.py '1b')", SIZES["1b"], "bfloat16",
                      target),
    ]
    reports[0]["dtype_reason"] = choice.reason
    return {"target": target, "jax": jax.__version__,
            "host_platform": jax.devices()[0].platform, "models": reports,
            "lowered": all(e["lowered"] for r in reports for e in r["exports"])}


def print_target_report(report: dict[str, Any]) -> None:
    """`target_report`'s report as text (what `doctor --target` prints without `--json`)."""
    target = report["target"]
    print(f"target: {target}, lowered here by jax.export (host: {report['host_platform']}, "
          f"jax {report['jax']}); nothing runs, nothing is calibrated")
    for rep in report["models"]:
        _print_report(rep, target)
    print(f"\nLOWERED: {report['lowered']}")


def doctor_target(args: argparse.Namespace) -> int:
    """Both models on `args.target`; exit 1 if any program failed to lower. With
    `--compile` (tpu only): doctor/compile.py."""
    if getattr(args, "compile", False):
        if args.target != "tpu":
            print(f"--compile: the TPU compiler only (no deviceless compiler for "
                  f"{args.target} here)")
            return 2
        from multiserve.doctor.compile import doctor_compile

        return doctor_compile(args)
    report = target_report(args.target, args.model, args.dtype)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_target_report(report)
    return 0 if report["lowered"] else 1
