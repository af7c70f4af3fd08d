"""`multiserve chaos`: the 4-engine tiny fleet under random load and random operations.

Owns `run_chaos(ChaosConfig)` -> `ChaosReport`:
1. writes the tiny model and a perturbed twin (tiny_model.py), launches 4 engines on 4
   CPU virtual devices with their servers and the supervisor, on loopback;
2. `clients` concurrent clients (chaos_workload.py) send random requests round-robin over
   the 4 ports and the front door (fleet/front_door.py) while the Operator (chaos_ops.py)
   fires operations for `seconds` (and until it has played every kind once); the clients
   go on until then AND until `min_completed` requests completed, `min_comparable` of
   them checkable against the reference: a count of requests, never a rate, so a slow
   machine runs longer rather than checking less (at most `max_seconds`, then the counts
   are what they are);
3. heals the fleet (continue, resume, base weights), then checks:
   - every request has exactly one final outcome, and none is hung, lost, dropped or an
     error without its OpenAI body;
   - every greedy request that completed outside a weight-change window equals the
     reference answer for its weight version (one undisturbed request per distinct
     prompt/params, sent afterwards with the fleet set to that version); a greedy
     request aborted that way has a prefix of it (native, by token ids);
   - every engine is healthy, idle and KV-whole (integrity.py);
   - process RSS and thread count before (warm fleet) and after are reported; the
     thread count must come back.
`chaos_main` is the command line. Bounded in time and count; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from multiserve.reliability.chaos_ops import BASE_VERSION, PERTURBED_VERSION, Operator, OpRecord
from multiserve.reliability.chaos_reference import check_against_reference, comparable
from multiserve.reliability.chaos_workload import VIOLATIONS, Outcome, random_spec, send

THREAD_SLACK = 2  # OS threads (e.g. of XLA) that may come and go
POOL_THREAD_PREFIX = "asyncio_"  # a server loop's default executor: bounded, reused


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float = 90.0
    clients: int = 16
    engines: int = 4
    max_requests: int = 100_000
    max_ops: int = 10_000
    op_gap_s: float = 1.0
    request_timeout_s: float = 120.0
    seed: int = 0
    min_completed: int = 0  # completed requests before the load may end
    min_comparable: int = 0  # of them, checkable against the reference
    max_seconds: float = 600.0  # the load ends by then whatever the counts


@dataclass
class ChaosReport:
    config: ChaosConfig
    outcomes: list[Outcome] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rss_mb: tuple[float, float] = (0.0, 0.0)
    threads: tuple[int, int] = (0, 0)
    new_threads: list[str] = field(default_factory=list)  # Python threads started, alive
    seconds: float = 0.0

    @property
    def violations(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind in VIOLATIONS]

    @property
    def ok(self) -> bool:
        return (not self.violations and not self.mismatches and not self.problems
                and not self.leaked_threads
                and self.threads[1] <= self.threads[0] + len(self.new_threads) + THREAD_SLACK)

    @property
    def leaked_threads(self) -> list[str]:
        """New Python threads still alive that are not of a bounded executor pool."""
        return [n for n in self.new_threads if not n.startswith(POOL_THREAD_PREFIX)]

    def lines(self) -> list[str]:
        kinds = Counter(o.kind for o in self.outcomes)
        by_api = Counter(f"{o.spec.kind}{'+stream' if o.spec.stream else ''}"
                         for o in self.outcomes)
        ops = Counter(f"{r.name}:{r.status or ('ok' if r.ok else 'error')}" for r in self.ops)
        out = [f"CHAOS: engines={self.config.engines} clients={self.config.clients} "
               f"seconds={self.seconds:.0f} requests={len(self.outcomes)} "
               f"operations={len(self.ops)}",
               "  outcomes: " + " ".join(f"{k}={n}" for k, n in sorted(kinds.items())),
               "  requests by api: " + " ".join(f"{k}={n}" for k, n in sorted(by_api.items())),
               "  operations: " + " ".join(f"{k}={n}" for k, n in sorted(ops.items())),
               f"  lost/hung/dropped/bad_error: {len(self.violations)}",
               f"  greedy compared with the reference: {self.compared}, "
               f"mismatches: {len(self.mismatches)}",
               f"  RSS MB before/after: {self.rss_mb[0]:.0f}/{self.rss_mb[1]:.0f}; "
               f"threads before/after: {self.threads[0]}/{self.threads[1]}"
               + (f" (new: {', '.join(self.new_threads)})" if self.new_threads else "")]
        out += [f"  VIOLATION {o.kind}: {o.spec} -> {o.error}" for o in self.violations[:10]]
        out += [f"  MISMATCH {m}" for m in self.mismatches[:10]]
        out += [f"  PROBLEM {p}" for p in self.problems[:10]]
        out.append(f"RESULT: {'PASS' if self.ok else 'FAIL'}")
        return out


def process_usage() -> tuple[float, int]:
    """(RSS in MB, OS threads) of this process, from /proc (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    rss_kb = float(fields.get("VmRSS", "0 kB").split()[0])
    return rss_kb / 1024.0, int(fields.get("Threads", threading.active_count()))


async def _load(fleet: Any, cfg: ChaosConfig, op: Operator, outcomes: list[Outcome],
                live: set[str]) -> None:
    start = time.monotonic()
    deadline, hard_deadline = start + cfg.seconds, start + max(cfg.seconds, cfg.max_seconds)
    model = fleet.workers[0].model_name
    # every engine port and the front door (which routes to them)
    ports = [*fleet.urls, *([fleet.front_door_url] if fleet.front_door_url else [])]
    sent = 0
    operator = asyncio.ensure_future(op.run(deadline, cfg.max_ops, cfg.op_gap_s))

    def enough() -> bool:
        """The load may end: its time is up, the operator is done, and the counts are
        reached (once the operator is done, no weight window moves any more)."""
        now = time.monotonic()
        if now >= hard_deadline:
            return True
        if now < deadline or not operator.done():
            return False
        completed = [o for o in outcomes if o.kind == "completed"]
        return (len(completed) >= cfg.min_completed
                and sum(comparable(o, op) for o in completed) >= cfg.min_comparable)

    async def client(i: int) -> None:
        nonlocal sent
        rng = random.Random(cfg.seed * 10_007 + i)
        async with httpx.AsyncClient() as http:
            k = 0
            while not enough() and sent < cfg.max_requests:
                sent += 1
                spec = random_spec(rng, f"chaos-{cfg.seed}-c{i}-{k}")
                url = ports[(i + k) % len(ports)]
                k += 1
                live.add(spec.rid)
                o = await send(http, url, model, spec, cfg.request_timeout_s)
                live.discard(spec.rid)
                outcomes.append(o)
                if o.kind == "refused":
                    await asyncio.sleep(0.2)  # e.g. an engine restarting: back off a little

    await asyncio.gather(operator, *(client(i) for i in range(cfg.clients)))
    await op.heal()


def run_chaos(cfg: ChaosConfig, *, log: Any = None) -> ChaosReport:
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.integrity import fleet_problems
    from multiserve.reliability.tiny_model import tiny_fleet_config, write_tiny_model

    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    report = ChaosReport(cfg)
    with tempfile.TemporaryDirectory(prefix="multiserve-chaos-") as tmp:
        checkpoints = {BASE_VERSION: str(write_tiny_model(Path(tmp) / "base", seed=0)),
                       PERTURBED_VERSION: str(write_tiny_model(Path(tmp) / "perturbed", seed=0,
                                                               perturb=0.3))}
        fleet = launch_fleet(tiny_fleet_config(checkpoints[BASE_VERSION], engines=cfg.engines),
                             announce=False)
        try:
            _warm(fleet, checkpoints, cfg.seed)
            rss0, threads0 = process_usage()
            names0 = Counter(t.name for t in threading.enumerate())
            say(f"chaos: fleet ready ({fleet.ready_line()}); {cfg.clients} clients for "
                f"{cfg.seconds:g} s")
            t0 = time.monotonic()
            outcomes: list[Outcome] = []
            live: set[str] = set()

            async def main() -> Operator:
                async with httpx.AsyncClient() as http:
                    op = Operator(fleet, http, random.Random(cfg.seed), checkpoints,
                                  lambda: sorted(live))
                    await _load(fleet, cfg, op, outcomes, live)
                    await check_against_reference(fleet, op, outcomes, report, checkpoints)
                    return op

            op = asyncio.run(main())
            report.seconds = time.monotonic() - t0
            report.outcomes, report.ops = outcomes, op.records
            report.problems += fleet_problems(fleet)
            for w in fleet.workers:  # a restarted engine compiles on a thread that then ends
                w.wait_compiled(600)
            rss1, threads1 = process_usage()
            # by name: a restarted engine's thread replaces the old one's (comparing thread
            # idents only worked while the OS happened to reuse the dead thread's id)
            names1 = Counter(t.name for t in threading.enumerate())
            report.new_threads = sorted((names1 - names0).elements())
            report.rss_mb, report.threads = (rss0, rss1), (threads0, threads1)
        finally:
            fleet.stop("abort")
    return report


def _warm(fleet: Any, checkpoints: dict[str, str], seed: int) -> None:
    """One request per engine and one of each operation, so that 'before' figures are of
    a warm fleet: first-use allocations (a restarted engine's buffers, staged weights,
    executor threads) are then not mistaken for leaks."""
    model = fleet.workers[0].model_name
    with httpx.Client(timeout=120) as http:
        for url in fleet.urls:
            r = http.post(f"{url}/v1/completions", json={"model": model, "prompt": "warm",
                                                         "max_tokens": 2})
            r.raise_for_status()

    async def ops() -> None:
        async with httpx.AsyncClient() as http:
            op = Operator(fleet, http, random.Random(seed), checkpoints, lambda: [])
            for card in op.deck():
                await card()
            await op.heal()

    asyncio.run(ops())


def chaos_main(args: argparse.Namespace) -> int:
    from multiserve.fleet.startup import init_jax

    init_jax("cpu", 4)
    cfg = ChaosConfig(seconds=args.minutes * 60.0, clients=args.clients, seed=args.seed,
                      max_requests=args.max_requests, max_ops=args.max_ops)
    report = run_chaos(cfg)
    for line in report.lines():
        print(line, flush=True)
    return 0 if report.ok else 1
