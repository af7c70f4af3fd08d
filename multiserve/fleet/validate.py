"""`multiserve validate`: start the fleet, load every port at once, check, report, exit.

Owns: the validation run (concurrent chat completions through the official `openai`
client, `requests_per_engine` to every engine port, same prompt, temperature 0), its
report lines and its checks:
  all_answered      every request got HTTP 200 with a non-empty answer
  concurrent        the requests overlapped: wall time < half the sum of latencies
  identical_greedy  every greedy answer is the same text, whichever engine served it

Report (stdout, one line each): `RESP: port=… status=… latency_sec=… text=…` per request,
`DONE: servers=N wall_sec=… max_req_sec=… sum_req_sec=… requests=… completion_tokens=…
tok_per_sec=…`, `CHECK: name=… ok=… detail=…` per check, then `RESULT: PASS|FAIL`.

Invariants: exit code 0 only if every check held; with `--force-exit` the process ends
with `os._exit` after stdout/stderr are flushed (no lingering thread can hang it), and a
watchdog ends it with code 1 if the whole run exceeds `--timeout`. `--inject-failure` is a
test hook that corrupts one answer before the identity check, so that check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from multiserve.config import ConfigError

REQUEST_TIMEOUT_S = 300.0
DEFAULT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Answer:
    port: int
    status: int  # HTTP status; 0 when no HTTP answer came (connection error, timeout)
    latency_sec: float
    text: str
    completion_tokens: int
    started: float
    ended: float


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Report:
    answers: list[Answer]
    wall_sec: float
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    def lines(self, servers: int) -> list[str]:
        out = [f"RESP: port={a.port} status={a.status} latency_sec={a.latency_sec:.3f} "
               f"text={json.dumps(a.text, ensure_ascii=False)}" for a in self.answers]
        lat = [a.latency_sec for a in self.answers]
        out.append(f"DONE: servers={servers} wall_sec={self.wall_sec:.3f} "
                   f"max_req_sec={max(lat, default=0.0):.3f} sum_req_sec={sum(lat):.3f} "
                   f"requests={len(self.answers)} completion_tokens={self.completion_tokens} "
                   f"tok_per_sec={self.completion_tokens / max(self.wall_sec, 1e-9):.1f}")
        out += [f"CHECK: name={c.name} ok={c.ok} detail={json.dumps(c.detail)}"
                for c in self.checks]
        out.append(f"RESULT: {'PASS' if self.ok else 'FAIL'}")
        return out


def client_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


async def send_requests(host: str, ports: list[int], model: str, *, requests_per_engine: int,
                        prompt: str, max_tokens: int, ignore_eos: bool = False,
                        timeout: float = REQUEST_TIMEOUT_S, api_key: str | None = None
                        ) -> tuple[list[Answer], float]:
    """All requests at once (one `AsyncOpenAI` client per port); (answers, wall seconds)."""
    import openai

    h = client_host(host)
    h = f"[{h}]" if ":" in h else h
    clients = {p: openai.AsyncOpenAI(base_url=f"http://{h}:{p}/v1", api_key=api_key or "none",
                                     max_retries=0, timeout=timeout) for p in ports}
    extra = {"ignore_eos": True} if ignore_eos else None

    async def one(port: int) -> Answer:
        t0 = time.monotonic()
        status, text, tokens = 200, "", 0
        try:
            resp = await clients[port].chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                temperature=0.0, max_tokens=max_tokens, extra_body=extra)
            text = resp.choices[0].message.content or ""
            tokens = resp.usage.completion_tokens if resp.usage else 0
        except openai.APIStatusError as e:
            status, text = e.status_code, f"error: {e.message}"
        except Exception as e:  # noqa: BLE001 - any failure is one failed request
            status, text = 0, f"error: {type(e).__name__}: {e}"
        t1 = time.monotonic()
        return Answer(port, status, t1 - t0, text, tokens, t0, t1)

    t0 = time.monotonic()
    try:
        answers = await asyncio.gather(*(one(p) for p in ports
                                         for _ in range(requests_per_engine)))
    finally:
        for c in clients.values():
            await c.close()
    return list(answers), time.monotonic() - t0


def evaluate(answers: list[Answer], wall_sec: float, *, inject_failure: bool = False
             ) -> list[Check]:
    bad = [a for a in answers if a.status != 200 or not a.text]
    checks = [Check("all_answered", not bad and bool(answers),
                    f"{len(answers) - len(bad)}/{len(answers)} answered"
                    + (f"; first failure: port {bad[0].port} status {bad[0].status}: "
                       f"{bad[0].text[:200]}" if bad else ""))]
    total = sum(a.latency_sec for a in answers)
    if len(answers) >= 2:
        checks.append(Check("concurrent", wall_sec < 0.5 * total,
                            f"wall {wall_sec:.3f} s vs sum {total:.3f} s "
                            f"(parallelism {total / max(wall_sec, 1e-9):.2f}x; need > 2x)"))
    texts = [a.text for a in answers if a.status == 200]
    injected = ""
    if inject_failure and texts:
        texts[-1] += " [injected mismatch]"
        injected = " (--inject-failure corrupted the last answer)"
    distinct = sorted(set(texts))
    ports = sorted({a.port for a in answers if a.status == 200})
    checks.append(Check("identical_greedy", len(distinct) == 1 and len(texts) == len(answers),
                        f"{len(distinct)} distinct answer(s) over {len(texts)} response(s) "
                        f"from ports {ports}{injected}"))
    return checks


def run_validation(fleet: Any, *, requests_per_engine: int, prompt: str, max_tokens: int,
                   ignore_eos: bool = False, inject_failure: bool = False) -> Report:
    """Load a started `Fleet` (launch.py) and check it; usable in-process by tests."""
    host = fleet.config.servers[0].host
    model = fleet.workers[0].model_name
    answers, wall = asyncio.run(send_requests(
        host, fleet.ports, model, requests_per_engine=requests_per_engine, prompt=prompt,
        max_tokens=max_tokens, ignore_eos=ignore_eos, api_key=fleet.config.api_key))
    return Report(answers, wall, evaluate(answers, wall, inject_failure=inject_failure))


def _finish(code: int, force_exit: bool) -> int:
    if force_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _start_watchdog(seconds: float) -> None:
    def fire() -> None:
        print(f"RESULT: FAIL (validation did not finish within {seconds:g} s)", flush=True)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def validate_main(args: argparse.Namespace) -> int:
    from multiserve.fleet.launch import launch_fleet
    from multiserve.fleet.startup import fleet_config_from_args

    force_exit = bool(getattr(args, "force_exit", False))
    if force_exit:
        _start_watchdog(float(getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S))
    try:
        cfg = fleet_config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return _finish(2, force_exit)
    if cfg.multihost.enabled and not cfg.multihost.is_leader:
        from multiserve.fleet.launch import follow_main

        return follow_main(cfg)  # node 0 validates; this host follows until it closes
    t0 = time.monotonic()
    try:
        fleet = launch_fleet(cfg)
    except Exception as e:  # noqa: BLE001 - a failed start-up is a failed validation
        print(f"RESULT: FAIL (start-up: {type(e).__name__}: {e})", flush=True)
        return _finish(1, force_exit)
    print(f"STARTUP: sec={time.monotonic() - t0:.1f}", file=sys.stderr, flush=True)
    try:
        report = run_validation(
            fleet, requests_per_engine=args.requests_per_engine, prompt=args.prompt,
            max_tokens=args.max_tokens, ignore_eos=bool(getattr(args, "ignore_eos", False)),
            inject_failure=bool(getattr(args, "inject_failure", False)))
        for line in report.lines(len(fleet.servers)):
            print(line, flush=True)
        code = 0 if report.ok else 1
    except Exception as e:  # noqa: BLE001 - reported as a failed validation
        print(f"RESULT: FAIL ({type(e).__name__}: {e})", flush=True)
        code = 1
    if force_exit:
        if fleet.slice_session is not None:  # the followers exit (0) before this host
            fleet.slice_session.leader.close()
        return _finish(code, True)
    fleet.stop("abort")
    if cfg.multihost.enabled:  # the followers have left: JAX's exit barrier would wait
        return _finish(code, True)
    return code
