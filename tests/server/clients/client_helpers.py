"""Shared by the client-family tests: `Live`, the running fleet as its clients see it
(imported by conftest.py and the test modules; the test dirs have no packages, so it is
imported by its unique module name)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

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
