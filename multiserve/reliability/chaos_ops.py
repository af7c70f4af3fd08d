"""The chaos run's operator: random supervisor and per-engine operations, one at a time.

Owns `Operator`, which fires (until a deadline or a count) a random choice of:
pause (every mode of PAUSE_MODES) then continue, and vLLM's /pause (abort | wait | keep)
then /resume, fleet-wide or on one engine; abort by
rid (a request seen in flight) and abort all; flush (refusals are expected while busy);
a staged, two-phase weight update to the perturbed checkpoint and back (under a retract
pause, so nothing is aborted); memory release (retract) then resume on one engine; and an
injected engine fault followed by a supervisor restart of that engine.

Invariants:
- Operations never overlap each other; each one leaves the fleet generating (every pause
  is followed by a continue, every release by a resume), so a request is never parked
  forever.
- `weight_windows` holds every interval in which the fleet's weights may have changed;
  `version` is the fleet's weight version outside them. A restart (base weights) only
  happens while the fleet serves the base version, so all engines always agree.
- Every answer is recorded (`OpRecord`); an HTTP error of an operation is an outcome, not
  a crash of the run. Traffic goes to the fleet's loopback URLs only.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from multiserve.engine.commands import InjectFault
from multiserve.types import PAUSE_MODES, EngineUnavailable


def _inject_fault(worker: Any, message: str) -> None:
    """The next step of the engine in `worker`'s slot raises RuntimeError(message)."""
    engine = worker.engine
    if engine is None:
        raise EngineUnavailable(f"engine {worker.index}: no engine in the slot")
    engine.call(InjectFault(message)).result()

BASE_VERSION = "default"  # what EngineConfig calls the weights an engine starts with
PERTURBED_VERSION = "perturbed"


@dataclass
class OpRecord:
    name: str
    target: str
    status: int | None
    ok: bool
    seconds: float
    message: str = ""


@dataclass
class Operator:
    fleet: Any
    http: httpx.AsyncClient
    rng: random.Random
    checkpoints: dict[str, str]  # weight version -> checkpoint dir
    live_rids: Callable[[], list[str]]
    version: str = BASE_VERSION
    weight_windows: list[tuple[float, float]] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)

    @property
    def sup(self) -> str:
        return self.fleet.supervisor_url

    async def _post(self, name: str, target: str, url: str, body: Any = None,
                    ok_statuses: tuple[int, ...] = (200,),
                    params: dict[str, str] | None = None) -> httpx.Response | None:
        t0 = time.monotonic()
        try:
            r = await self.http.post(url, json=body, timeout=300, params=params)
        except httpx.HTTPError as e:
            self.records.append(OpRecord(name, target, None, False, time.monotonic() - t0,
                                         f"{type(e).__name__}: {e}"))
            return None
        msg = ""
        try:
            msg = str(r.json().get("message", ""))[:160]
        except ValueError:
            msg = r.text[:160]
        self.records.append(OpRecord(name, target, r.status_code, r.status_code in ok_statuses,
                                     time.monotonic() - t0, msg))
        return r

    async def _pause_continue(self, mode: str, fleet_wide: bool) -> None:
        i = self.rng.randrange(len(self.fleet.urls))
        base, target = (self.sup, "fleet") if fleet_wide else (self.fleet.urls[i], f"engine {i}")
        await self._post(f"pause_{mode}", target, f"{base}/pause_generation", {"mode": mode})
        await asyncio.sleep(self.rng.uniform(0.05, 0.8))
        await self._post("continue", target, f"{base}/continue_generation")

    async def _vllm_pause(self, mode: str, fleet_wide: bool) -> None:
        """vLLM's /pause?mode=... (abort | wait | keep), then /resume."""
        i = self.rng.randrange(len(self.fleet.urls))
        base, target = (self.sup, "fleet") if fleet_wide else (self.fleet.urls[i], f"engine {i}")
        clear = self.rng.choice(("true", "false"))
        await self._post(f"vllm_pause_{mode}", target, f"{base}/pause",
                         params={"mode": mode, "clear_cache": clear})
        await asyncio.sleep(self.rng.uniform(0.05, 0.8))
        await self._post("vllm_resume", target, f"{base}/resume")

    async def _abort(self, by_rid: bool) -> None:
        rids = self.live_rids()
        if by_rid and rids:
            await self._post("abort_rid", "fleet", f"{self.sup}/abort_request",
                             {"rid": self.rng.choice(rids)})
        else:
            i = self.rng.randrange(len(self.fleet.urls))
            await self._post("abort_all", f"engine {i}",
                             f"{self.fleet.urls[i]}/abort_request", {"abort_all": True})

    async def _flush(self) -> None:
        await self._post("flush", "fleet", f"{self.sup}/flush_cache", ok_statuses=(200, 400))

    async def _weights(self) -> None:
        new = PERTURBED_VERSION if self.version == BASE_VERSION else BASE_VERSION
        t0 = time.monotonic()
        await self._post("pause_retract", "fleet", f"{self.sup}/pause_generation",
                         {"mode": "retract"})
        r = await self._post(f"update_weights->{new}", "fleet",
                             f"{self.sup}/update_weights_from_disk",
                             {"path": self.checkpoints[new], "weight_version": new})
        if r is not None and r.status_code == 200:
            self.version = new
        await self._post("continue", "fleet", f"{self.sup}/continue_generation")
        self.weight_windows.append((t0, time.monotonic()))

    async def _memory(self) -> None:
        i = self.rng.randrange(len(self.fleet.urls))
        url = self.fleet.urls[i]
        await self._post("release_memory", f"engine {i}", f"{url}/release_memory_occupation",
                         {"mode": "retract"})
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        await self._post("resume_memory", f"engine {i}", f"{url}/resume_memory_occupation", {})

    async def _fault_restart(self) -> None:
        if self.version != BASE_VERSION:
            await self._weights()  # a restart brings base weights back: go there first
        if self.version != BASE_VERSION:
            return None  # the update back failed (recorded): no restart on mixed weights
        i = self.rng.randrange(len(self.fleet.workers))
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(_inject_fault, self.fleet.workers[i],
                                    "chaos: injected fault")
        except Exception as e:  # noqa: BLE001 - e.g. the engine is not there: recorded
            self.records.append(OpRecord("inject_fault", f"engine {i}", None, False,
                                         time.monotonic() - t0, f"{type(e).__name__}: {e}"))
            return None
        self.records.append(OpRecord("inject_fault", f"engine {i}", None, True,
                                     time.monotonic() - t0, "next step raises"))
        await asyncio.sleep(self.rng.uniform(0.1, 0.5))  # let traffic meet the fault
        await self._post("restart_engine", f"engine {i}", f"{self.sup}/restart_engine",
                         {"engine": i})
        return None

    def deck(self) -> list[Callable[[], Any]]:
        """One of each operation (pauses in every mode, fleet-wide and per engine),
        shuffled: a run of len(deck) operations covers every kind."""
        cards: list[Callable[[], Any]] = [
            lambda: self._pause_continue("abort", True),
            lambda: self._pause_continue("retract", True),
            lambda: self._pause_continue("in_place", True),
            lambda: self._pause_continue(self.rng.choice(PAUSE_MODES), False),
            lambda: self._vllm_pause("abort", True), lambda: self._vllm_pause("wait", True),
            lambda: self._vllm_pause("keep", True),
            lambda: self._vllm_pause(self.rng.choice(("abort", "wait", "keep")), False),
            lambda: self._abort(True), lambda: self._abort(True), lambda: self._abort(False),
            self._flush, self._weights, self._memory, self._fault_restart]
        self.rng.shuffle(cards)
        return cards

    async def run(self, deadline: float, max_ops: int, mean_gap_s: float) -> None:
        """Operations at random gaps until `deadline`, from shuffled decks of every kind;
        the first deck is always played out (past the deadline if need be), so every run
        covers every operation at least once, however short."""
        cards = self.deck()
        first_deck = len(cards)

        def over(n: int) -> bool:  # past the deadline, the first deck played out
            return time.monotonic() >= deadline and n >= first_deck

        for n in range(max_ops):
            if over(n):
                break
            await asyncio.sleep(self.rng.expovariate(1.0 / mean_gap_s))
            if over(n):
                break
            if not cards:
                cards = self.deck()
            await cards.pop()()

    async def heal(self) -> None:
        """Leave the fleet generating on the base weights (end of the chaos phase)."""
        await self._post("continue", "fleet", f"{self.sup}/continue_generation")
        await self._post("resume_memory", "fleet", f"{self.sup}/resume_memory_occupation", {},
                         ok_statuses=(200, 400))
        if self.version != BASE_VERSION:
            await self._weights()
