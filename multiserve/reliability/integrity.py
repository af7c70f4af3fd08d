"""After a fuzz or chaos run: is every engine healthy, idle and whole?

Owns `fleet_problems(fleet)`: for each engine of an in-process `Fleet`, over HTTP on
loopback (GET /health, /get_server_info, POST /flush_cache) and on the engine thread
(`Scheduler.check_integrity`): healthy, unpaused, no request left, every KV page either
free or in an unreferenced prefix cache, and after a flush every KV token free again.
Returns a list of problems (empty: all good).

Invariant: read-only except the final flush (which the checks require) and a continue /
resume if a run left an engine paused or asleep (reported as a problem all the same).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from multiserve.engine.commands import CheckIntegrity

IDLE_TIMEOUT_S = 120.0


def _idle(st: dict[str, Any]) -> bool:
    return (st.get("running_batch_size") == 0 and st.get("waiting_queue_size") == 0
            and not st.get("cur_batch"))


def engine_problems(http: httpx.Client, url: str, engine: Any, i: int) -> list[str]:
    out: list[str] = []
    r = http.get(f"{url}/health")
    if r.status_code != 200 or r.json().get("status") != "ok":
        out.append(f"engine {i}: /health answered {r.status_code} {r.text[:200]}")
        if r.status_code != 200:
            return out
    st = http.get(f"{url}/get_server_info").json()
    if st.get("engine_paused") or st.get("memory_released"):
        out.append(f"engine {i}: left paused={st.get('engine_paused')} "
                   f"released={st.get('memory_released')}")
        http.post(f"{url}/continue_generation")
        http.post(f"{url}/resume_memory_occupation", json={})
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while not _idle(st := http.get(f"{url}/get_server_info").json()):
        if time.monotonic() > deadline:
            out.append(f"engine {i}: not idle after {IDLE_TIMEOUT_S:g} s: running="
                       f"{st.get('running_rids')} waiting={st.get('waiting_rids')}")
            return out
        time.sleep(0.05)
    if engine is not None:
        try:
            engine.call(CheckIntegrity()).result()
        except AssertionError as e:
            out.append(f"engine {i}: check_integrity failed: {e}")
    if st["req_to_token_pool_used"] != 0:
        out.append(f"engine {i}: req_to_token_pool_used={st['req_to_token_pool_used']}")
    if st["tree_cache_size"] != st["evictable_kv_tokens"]:
        out.append(f"engine {i}: referenced cache pages while idle: tree="
                   f"{st['tree_cache_size']} evictable={st['evictable_kv_tokens']}")
    if st["available_kv_tokens"] + st["evictable_kv_tokens"] != \
            st["initial_available_kv_tokens"]:
        out.append(f"engine {i}: KV leak: available {st['available_kv_tokens']} + evictable "
                   f"{st['evictable_kv_tokens']} != {st['initial_available_kv_tokens']}")
    r = http.post(f"{url}/flush_cache")
    st = http.get(f"{url}/get_server_info").json()
    if r.status_code != 200 or st["available_kv_tokens"] != st["initial_available_kv_tokens"] \
            or st["tree_cache_size"] != 0:
        out.append(f"engine {i}: after flush ({r.status_code}): available "
                   f"{st['available_kv_tokens']} of {st['initial_available_kv_tokens']}, "
                   f"tree {st['tree_cache_size']}")
    return out


def fleet_problems(fleet: Any, headers: dict[str, str] | None = None) -> list[str]:
    """Every engine of `fleet` checked (see the module docstring); also the supervisor's
    /health."""
    out: list[str] = []
    with httpx.Client(timeout=60.0, headers=headers) as http:
        for i, (url, w) in enumerate(zip(fleet.urls, fleet.workers, strict=True)):
            try:
                out += engine_problems(http, url, w.engine, i)
            except (httpx.HTTPError, KeyError, ValueError) as e:
                out.append(f"engine {i}: integrity check failed: {type(e).__name__}: {e}")
        r = http.get(f"{fleet.supervisor_url}/health")
        if r.status_code != 200:
            out.append(f"supervisor /health: {r.status_code} {r.text[:200]}")
    return out
