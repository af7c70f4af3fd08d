"""`multiserve doctor`: the invariance plan of this machine for a model and engine config,
with the probe table behind it (which candidate each primitive got, and why)."""

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
    import jax
    import numpy as np

    from multiserve.engine.device.program_share import hook_problem
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.workload import default_workload
    from multiserve.model.loading.loader import load_model

    cfg = load_model(args.model, np.float32).config
    workload = default_workload(cfg, np.dtype(args.dtype), tp=args.tp)
    cal = calibrate(workload, jax.devices()[0], use_cache=not args.reprobe)
    sharing_problem = hook_problem()  # None: a fleet's engines share compiled programs
    if args.json:
        print(json.dumps({**cal.summary(), "program_sharing_hook": sharing_problem or "ok",
                          "table": list(cal.table)}, indent=1))
        return 0 if cal.plan.verified else 1
    print(f"backend: {cal.key['platform']} {_cpu_line(cal.key)}; jax {cal.key['jax']}")
    print(f"key {cal.key_hash}: {'read from the cache' if cal.cached else 'probed now'}, "
          f"probe took {cal.probe_seconds:.1f} s")
    print("program sharing (a fleet's engines compile each program once): " + (
        "available" if sharing_problem is None else f"off, {sharing_problem}"))
    print(f"VERIFIED: {cal.plan.verified}" + "".join(f"\n  problem: {p}"
                                                   for p in cal.plan.problems))
    for row in cal.table:
        mark = "*" if row["chosen_for"] else " "
        what = {k: v for k, v in row.items() if k not in (
            "primitive", "chosen_for", "position_invariant", "matches_reference", "ms",
            "reference")}
        why = ("reference" if row["reference"] else "== reference" if row["matches_reference"]
               else "position-dependent" if not row["position_invariant"] else "differs")
        used = f" used for {row['chosen_for']}" if row["chosen_for"] else ""
        print(f"{mark} {row['primitive']:9} {what} {row['ms']:.3f} ms  {why}{used}")
    return 0 if cal.plan.verified else 1
