"""`multiserve doctor`: the invariance plan of this machine for a model and engine config,
with the probe table behind it (which candidate each primitive got, and why), the dtype
an engine of that model would compute in ("auto" resolved as the engine resolves it,
engine/base/dtype_choice.py) and the bfloat16 products' instruction path. With `--target cuda|tpu`:
what an engine would run on that accelerator, lowered here without it (doctor/target.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _cpu_line(key: dict[str, Any]) -> str:
    cpu = key.get("cpu", {})
    flags = cpu.get("flags", "")
    isa = " ".join(f for f in flags.split() if f.startswith(("avx", "fma", "amx")))
    return f"{cpu.get('model name', key.get('device_kind', '?'))} [{isa}]"


def doctor_main(args: argparse.Namespace) -> int:
    if getattr(args, "target", None):
        from multiserve.doctor.target import doctor_target

        return doctor_target(args)
    import jax
    import numpy as np

    from multiserve.engine.base.dtype_choice import choose_dtype
    from multiserve.engine.device.program_share import hook_problem
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.workload import default_workload
    from multiserve.model.kernels import native as native_kernels
    from multiserve.model.loading.loader import load_model, numpy_dtype, resolve_model_dir

    device = jax.devices()[0]
    model_dir = None if args.model is None else resolve_model_dir(args.model)
    cfg = load_model(model_dir, np.float32).config
    reason = native_kernels.unavailable_reason("bfloat16") if args.dtype == "auto" else None
    choice = choose_dtype(args.dtype, device.platform, model_dir, reason,
                          ", ".join(native_kernels.bf16_path_candidates())
                          if reason is None else None)
    workload = default_workload(cfg, numpy_dtype(choice.dtype), tp=args.tp)
    cal = calibrate(workload, device, use_cache=not args.reprobe)
    sharing_problem = hook_problem()  # None: a fleet's engines share compiled programs
    bf16 = {"bf16_plan_path": cal.plan.bf16_path,
            "bf16_path_candidates": list(native_kernels.bf16_path_candidates()),
            "bf16_paths_available": list(native_kernels.bf16_paths_available())}
    if args.json:
        tuning = (native_kernels.tuned() if native_kernels.unavailable_reason() is None
                  else None)
        bf16["product_tuning"] = None if tuning is None else {**tuning.key(),
                                                              "source": tuning.source}
        print(json.dumps({**cal.summary(), "dtype_choice": choice.summary(), **bf16,
                          "program_sharing_hook": sharing_problem or "ok",
                          "table": list(cal.table)}, indent=1))
        return 0 if cal.plan.verified else 1
    print(f"backend: {cal.key['platform']} {_cpu_line(cal.key)}; jax {cal.key['jax']}")
    print(f"dtype: {choice.dtype} ({choice.reason})")
    chosen = bf16["bf16_plan_path"] or ("none in this plan" if bf16["bf16_paths_available"]
                                        else "no native kernels")
    print(f"bfloat16 products: {chosen} (timed by the calibration: "
          f"{', '.join(bf16['bf16_path_candidates']) or 'none'}; paths here: "
          f"{', '.join(bf16['bf16_paths_available']) or 'none'})")
    if native_kernels.unavailable_reason() is None:
        tuning = native_kernels.tuned()
        print(f"native products: split over the pool from {tuning.split_units} work units, "
              f"one-block prefetch {tuning.ahead_bytes} bytes ahead ({tuning.source}; "
              f"MULTISERVE_PRODUCT_TUNING sets them)")
    print(f"key {cal.key_hash}: {'read from the cache' if cal.cached else 'probed now'}, "
          f"probe took {cal.probe_seconds:.1f} s")
    print("program sharing (a fleet's engines compile each program once): " + (
        "available" if sharing_problem is None else f"off, {sharing_problem}"))
    print(f"VERIFIED: {cal.plan.verified}" + "".join(f"\n  problem: {p}"
                                                   for p in cal.plan.problems))
    for row in cal.table:
        if row["primitive"] == "bf16_path":  # a path's plans' cost over every product
            print(f"{'*' if row['chosen'] else ' '} bf16_path {row['path']}: cost "
                  f"{row['cost']} (each size's time over the fastest there, summed)")
            continue
        mark = "*" if row["chosen_for"] else " "
        what = {k: v for k, v in row.items() if k not in (
            "primitive", "chosen_for", "position_invariant", "matches_reference", "ms",
            "reference")}
        why = ("reference" if row["reference"] else "== reference" if row["matches_reference"]
               else "position-dependent" if not row["position_invariant"] else "differs")
        used = f" used for {row['chosen_for']}" if row["chosen_for"] else ""
        print(f"{mark} {row['primitive']:9} {what} {row['ms']:.3f} ms  {why}{used}")
    return 0 if cal.plan.verified else 1
