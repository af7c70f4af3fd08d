"""`multiserve bench --agent-sessions S --agent-turns T`: a multi-turn agent workload through
the fleet's front door, against the same clients spread over the engine ports at random,
and against sglang-router's cache_aware policy when it is installed, in one run.

The fleet (configs/cpu-4.toml unless --config, the default model unless --model) starts
with its front door, every engine's buckets compiled. The workload: S sessions at once,
each T sequential turns of OpenAI chat completions (greedy, max_tokens 24): turn 1 is a
shared agent system prompt and the session's task; every later turn appends the reply and
a tool observation (deterministic text) to the conversation. The arms, each cold (every
prefix cache flushed first) and with the same requests:
- front_door: every request to the front door, `X-Session-ID: <session>` (prime-rl's,
  SkyRL's header): sticky by session;
- random_ports: each turn to an engine port drawn at random (seeded, per session);
- sglang_router: sglang-router (the `sglang-router` package, --policy cache_aware) in
  front of the 4 engine ports, as sops/multi-host-router.md starts it.
Per arm: the prefix-cache hit rate (cached / prompt tokens, from each answer's
usage.prompt_tokens_details), completion tok/s and requests/s over the arm's wall time,
requests per engine; and whether every arm's transcripts are identical (greedy: a reply
does not depend on the engine that computed it). The JSON line is the contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from multiserve.bench.options import BenchOptions
from multiserve.bench.prompts import bench_prompts

MAX_TOKENS = 24
SYSTEM = ("You are a careful software agent. You solve the user's task step by step. Each "
          "turn you either call one tool or answer. Tools: search(query) returns the top "
          "documents; read(path) returns a file; run(command) runs a shell command and "
          "returns its output; write(path, text) writes a file. Reply with one short line: "
          "the tool call you make next, or ANSWER: followed by the answer. Keep every "
          "reply brief; never repeat the observation back.")


def observation(session: int, turn: int) -> str:
    return (f"Observation {turn} (session {session}): the tool returned {3 + turn} lines; "
            f"line 1 reads 'status ok, item {session * 7 + turn}', line 2 lists the files "
            f"a.py, b.py and notes.txt, line 3 says the next step is to check the tests.")


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine: int | None


@dataclass
class Arm:
    name: str
    turns: list[Turn]
    transcripts: list[list[str]]
    wall_s: float

    def figures(self, num_engines: int) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        done = sum(t.completion_tokens for t in self.turns)
        per_engine = [sum(t.engine == i for t in self.turns) for i in range(num_engines)]
        return {"requests": len(self.turns), "prompt_tokens": prompt, "cached_tokens": cached,
                "prefix_hit_rate": cached / prompt if prompt else 0.0,
                "completion_tokens": done, "wall_s": self.wall_s,
                "tokens_per_s": done / self.wall_s if self.wall_s else 0.0,
                "requests_per_s": len(self.turns) / self.wall_s if self.wall_s else 0.0,
                "requests_per_engine": per_engine}


async def run_arm(name: str, pick: Any, model: str, tasks: Sequence[str], turns: int,
                  engine_of: Any) -> Arm:
    """Every session concurrently, each its turns in order; `pick(session, turn)` ->
    (URL, headers); `engine_of(url, response)` -> the engine index that served it."""
    import httpx

    records: list[Turn] = []
    transcripts: list[list[str]] = [[] for _ in tasks]

    async def session(http: httpx.AsyncClient, i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": tasks[i]}]
        for t in range(turns):
            url, headers = pick(i, t)
            r = await http.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"bench --agent-sessions: {name} turn {t} of session {i}: "
                                   f"HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
            reply = body["choices"][0]["message"]["content"] or ""
            usage = body["usage"]
            details = usage.get("prompt_tokens_details") or {}
            records.append(Turn(usage["prompt_tokens"], int(details.get("cached_tokens") or 0),
                                usage["completion_tokens"], engine_of(url, r)))
            transcripts[i].append(reply)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": observation(i, t + 1)}]

    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(http, i) for i in range(len(tasks))))
        wall = time.perf_counter() - t0
    return Arm(name, records, transcripts, wall)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangRouter:
    """sglang-router over the engine ports (cache_aware), as a subprocess of its own
    session, stopped with it."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-urls", *urls, "--policy", "cache_aware",
               "--log-level", "warn", "--worker-startup-timeout-secs", "120"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self, workers: int, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("bench: sglang-router exited at start")
            try:
                listed = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                if len(listed) == workers and all(w["is_healthy"] for w in listed):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("bench: sglang-router's workers not healthy in time")
            time.sleep(0.2)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)  # the router this bench started, only it
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)


def _forward_counts(fleet: Any) -> list[int]:
    return [int(w.get_internal_state()["forward_ct"]) for w in fleet.workers]


def run_agent_bench(cfg: Any, sessions: int, turns: int, seed: int = 0,
                    with_router: bool = True, log: Any = None) -> dict[str, Any]:
    from multiserve.bench.fleet_bench import _cold, _start

    fleet, startup_s, all_compiled_s = _start(cfg, log)
    router = None
    try:
        urls, door = fleet.urls, fleet.front_door_url
        assert door is not None, "the agent bench needs the fleet's front door"
        model = fleet.workers[0].model_name
        tasks = [f"Task: {p}" for p in bench_prompts(sessions)]
        port_index = {u: i for i, u in enumerate(urls)}

        def by_port(url: str, _: Any) -> int | None:
            return port_index.get(url)

        def by_header(_: str, r: Any) -> int | None:
            return int(r.headers["x-routed-engine"])

        arms: dict[str, Any] = {}
        rngs = [random.Random(seed * 1000 + i) for i in range(sessions)]
        picks = {
            "random_ports": (lambda i, t: (rngs[i].choice(urls), {}), by_port),
            "front_door": (lambda i, t: (door, {"X-Session-ID": f"agent-{i}"}), by_header),
        }
        if with_router:
            router = SglangRouter(urls)
            router.wait_ready(len(urls))
            picks["sglang_router"] = (lambda i, t: (router.url, {}), lambda u, r: None)
        # warm the HTTP and chat path of every way in (not measured)
        asyncio.run(run_arm("warm", lambda i, t: ([*urls, door][i % (len(urls) + 1)], {}),
                            model, tasks[:len(urls) + 1], 1, by_port))
        transcripts = {}
        for name, (pick, engine_of) in picks.items():
            arm, steps = _cold(fleet, lambda p=pick, e=engine_of, n=name: asyncio.run(
                run_arm(n, p, model, tasks, turns, e)))
            figures = arm.figures(len(urls))
            if name == "sglang_router":  # which engine: from the engines' step counts
                figures["requests_per_engine"] = None
            figures["steps_per_engine"] = steps
            arms[name] = figures
            transcripts[name] = arm.transcripts
        stats = _door_stats(door)
        groups = fleet.device_groups
    finally:
        if router is not None:
            router.stop()
        fleet.stop("abort")
    first = next(iter(transcripts.values()))
    return {"bench": "multiserve", "mode": "agent", "model": model,
            "num_engines": len(groups), "sessions": sessions, "turns": turns,
            "max_tokens": MAX_TOKENS, "startup_s": startup_s,
            "all_compiled_s": all_compiled_s, "arms": arms, "front_door_stats": stats,
            "outputs_identical": all(t == first for t in transcripts.values())}


def _door_stats(door: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{door}/routing_stats", timeout=10).json()


def agent_table(res: dict[str, Any]) -> list[str]:
    out = [f"agent benchmark: {res['sessions']} sessions x {res['turns']} turns of chat "
           f"(greedy, max_tokens {res['max_tokens']}), {res['num_engines']} engines, "
           f"{res['model']}",
           f"{'':<16}{'hit rate':>9}{'tok/s':>8}{'req/s':>7}{'wall s':>8}  requests per engine"]
    for name, a in res["arms"].items():
        per = a["requests_per_engine"]
        out.append(f"{name:<16}{a['prefix_hit_rate']:>9.3f}{a['tokens_per_s']:>8.1f}"
                   f"{a['requests_per_s']:>7.2f}{a['wall_s']:>8.1f}  "
                   f"{per if per is not None else '(steps ' + str(a['steps_per_engine']) + ')'}")
    out.append(f"transcripts identical across the arms: {res['outputs_identical']}")
    return out


def agent_main(options: BenchOptions) -> int:
    from multiserve.bench.fleet_bench import fleet_config
    from multiserve.config import ServerConfig

    if options.agent_sessions < 1 or options.agent_turns < 1:
        raise SystemExit("bench: --agent-sessions and --agent-turns must be >= 1")
    cfg = replace(fleet_config(options), front_door=ServerConfig(host="127.0.0.1", port=0))
    try:
        import sglang_router  # noqa: F401 - only whether the router is installed
        with_router = True
    except ImportError:
        with_router = False
    result = run_agent_bench(cfg, options.agent_sessions, options.agent_turns,
                             seed=options.seed, with_router=with_router)
    print("\n".join(["", *agent_table(result)]), file=sys.stdout)
    print(json.dumps(result), flush=True)
    return 0
