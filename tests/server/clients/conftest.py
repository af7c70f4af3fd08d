"""Fixtures for the client-family tests: each module replays one client's exact HTTP
requests (slime, AReaL, verl, tunix, sglang-router) against real servers on loopback.

`fleet` is one 4-engine fleet of the tiny random model (multiserve/reliability/
tiny_model.py: the default tokenizer's full vocabulary, so text and chat prompts work),
launched once per session in this process, on the 4 CPU virtual devices, with the shapes
the reliability tests compile (the persistent compilation cache makes warm-up short).
Its engine ports stand for 4 sglang servers (what a router fronts); its supervisor is
the fleet-wide control point. Tests leave every engine idle, unpaused, awake and on the
base weights (`clean` checks and restores that around each test).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from client_helpers import Live


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from multiserve.reliability.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("clients")
    return (write_tiny_model(root / "tiny", seed=0),
            write_tiny_model(root / "tiny-perturbed", seed=0, perturb=0.5))


@pytest.fixture(scope="session")
def _live(checkpoints: tuple[Path, Path]) -> Iterator[Live]:
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.tiny_model import tiny_fleet_config

    base, perturbed = checkpoints
    fleet = launch_fleet(tiny_fleet_config(base, engines=4), announce=False)
    live = Live(fleet, base, perturbed)
    try:
        r = live.http.post(f"{live.supervisor}/update_weights_from_disk",
                           json={"model_path": str(base), "weight_version": "base"})
        assert r.status_code == 200, r.text
        yield live
    finally:
        live.http.close()
        fleet.stop("abort")


@pytest.fixture()
def live(_live: Live) -> Iterator[Live]:
    """The fleet, clean before and after the test."""
    _live.restore()
    yield _live
    _live.restore()
