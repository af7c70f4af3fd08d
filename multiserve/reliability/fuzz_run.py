"""`multiserve fuzz`: schema-fuzz one engine app, the supervisor app and the front door of a
tiny fleet.

Owns `run_fuzz(cases_per_app, ...)`: writes the tiny random model (tiny_model.py),
launches a fleet of it in this process on loopback (ephemeral ports), fuzzes the engine
app, the supervisor app, then the front door (fuzz.py), then checks every engine
(integrity.py): healthy, idle, KV whole. `fuzz_main` is the command line.

Invariant: the fleet is always stopped, whatever happened; the result says ok only if
no case violated the rules and every post-check held.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multiserve.reliability.fuzz import FuzzReport, fuzz_server


@dataclass
class FuzzResult:
    reports: list[FuzzReport]
    problems: list[str] = field(default_factory=list)
    then: Any = None  # what `run_fuzz`'s `then` returned

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.reports)

    def lines(self) -> list[str]:
        out = [line for r in self.reports for line in r.lines()]
        out += [f"POST-CHECK problem: {p}" for p in self.problems]
        out.append(f"RESULT: {'PASS' if self.ok else 'FAIL'}")
        return out


def run_fuzz(cases_per_app: int, *, seed: int = 0, model_dir: Path | None = None,
             engines: int = 1, front_door_cases: int | None = None,
             then: Callable[[Any], Any] | None = None) -> FuzzResult:
    """Fuzz the engine app and the supervisor app with `cases_per_app` cases each, then
    the fleet's front door with `front_door_cases` (default: a third as many: it relays
    the engine's generation routes, fuzzed already behind it); then `then(fleet)`, if
    given (its result in `FuzzResult.then`: more runs on the same fleet, which the
    post-check covers too)."""
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.integrity import fleet_problems
    from multiserve.reliability.tiny_model import tiny_fleet_config, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="multiserve-fuzz-") as tmp:
        model = model_dir or write_tiny_model(Path(tmp) / "tiny", seed=0)
        # LoRA on (two slots): the adapter routes reach the engine's slot table
        fleet = launch_fleet(tiny_fleet_config(model, engines=engines, max_loras_per_batch=2),
                             announce=False)
        try:
            door = cases_per_app // 3 if front_door_cases is None else front_door_cases
            reports = [fuzz_server("engine", fleet.urls[0], cases_per_app, seed=seed),
                       fuzz_server("supervisor", fleet.supervisor_url, cases_per_app,
                                   seed=seed + 1)]
            if fleet.front_door_url is not None and door > 0:
                reports.append(fuzz_server("front_door", fleet.front_door_url, door,
                                           seed=seed + 2))
            extra = then(fleet) if then is not None else None
            return FuzzResult(reports, fleet_problems(fleet), extra)
        finally:
            fleet.stop("abort")


def fuzz_main(args: argparse.Namespace) -> int:
    from multiserve.fleet.startup import init_jax

    init_jax("cpu", max(1, args.engines))
    result = run_fuzz(args.cases, seed=args.seed, engines=args.engines)
    for line in result.lines():
        print(line, flush=True)
    sys.stdout.flush()
    return 0 if result.ok else 1
