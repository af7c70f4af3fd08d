"""The engine settings of the shipped main job, for every test that serves the embedded
default model: configs/cpu-4.toml's [engine] (what `scripts/fleet.sh` serves) on device 0,
with tests/fleet/test_fleet_validate.py's KV pool (4096 tokens). Every such test then has
the programs and the invariance plan of the validate run's fleet and of each other, so
whichever runs first compiles and calibrates and the others find both in the suite's
caches (the persistent compilation cache, the plan cache)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

CPU4 = Path(__file__).resolve().parents[1] / "configs" / "cpu-4.toml"
KV_TOKENS = 4096  # test_fleet_validate.py's pool
# The shipped main job's fused step programs (configs/cpu-4.toml's fused_step_max: only
# for decodes of a few rows), which the suite's test engines take too: at larger buckets
# they run the two-program step the shipped fleet runs there and compile no fused program
# (each is a whole forward + sampler: the suite's most expensive compile). The fused
# programs' bits are checked by tests/engine/test_fused_step.py, by the default-model
# engines (test_determinism.py, the fleet tests) and by every engine's prime where it has one.
SHIPPED_FUSED_STEP_MAX: int = tomllib.loads(CPU4.read_text())["engine"]["fused_step_max"]


def shipped_engine_config(**overrides: Any) -> Any:
    """configs/cpu-4.toml's first engine, its pool KV_TOKENS, no progress bars; `overrides`
    (EngineConfig fields that change no program: where to run, how to warm up) on top."""
    from multiserve.fleet.config_loader import load_fleet_config

    fleet = load_fleet_config(CPU4, {"engine.max_total_tokens": KV_TOKENS,
                                     "engine.show_progress": False})
    return fleet.engines[0].with_updates(**overrides) if overrides else fleet.engines[0]
