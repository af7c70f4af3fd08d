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

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

WAIT_S = 60.0


class Live:
    """The running fleet as its clients see it: engine URLs, supervisor URL, the
    checkpoints on disk, and a sync http client."""

    def __init__(self, fleet: Any, base: Path, perturbed: Path) -> None:
        self.fleet = fleet
        self.urls: list[str] = list(fleet.urls)
        self.url = self.urls[0]
        self.supervisor = fleet.supervisor_url
        self.base, self.perturbed = base, perturbed
        self.http = httpx.Client(timeout=120)
        self.model_name: str = fleet.workers[0].model_name

    def state(self, url: str | None = None) -> dict[str, Any]:
        r = self.http.get(f"{url or self.url}/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_state(self, pred: Any, url: str | None = None,
                   timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.state(url)
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout}s: {st}")
            time.sleep(0.02)

    def restore(self) -> None:
        """Every engine idle, unpaused, awake, on the base weights."""
        sup = self.supervisor
        self.http.post(f"{sup}/resume_memory_occupation", json={})
        self.http.post(f"{sup}/continue_generation")
        self.http.post(f"{sup}/abort_request", json={"abort_all": True})
        if self.http.get(f"{sup}/get_weight_version").json()["weight_version"] != "base":
            r = self.http.post(f"{sup}/update_weights_from_disk",
                               json={"model_path": str(self.base), "weight_version": "base",
                                     "abort_all_requests": True})
            assert r.status_code == 200, r.text
        for url in self.urls:
            self.wait_state(lambda s: not s["engine_paused"] and s["running_batch_size"] == 0
                            and s["waiting_queue_size"] == 0 and not s["memory_released"],
                            url)


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
