"""Four real engines on four virtual devices in this process, each behind its own real
uvicorn server on loopback, plus the supervisor (configs/cpu-4.toml, ephemeral ports,
a small KV pool).

What is checked: 16 concurrent `openai` clients over the 4 ports all get the same greedy
answer; every engine's device arrays live only on its own device; a supervisor pause (each
mode) while every engine streams stops every engine's step counter and, after continue,
every stream ends as it would have without the pause; a fault in one engine makes only
its port answer 503 (with the reason) and the supervisor's restart brings it back.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from multiserve.engine.commands import Call, InjectFault
from multiserve.fleet.config_loader import load_fleet_config
from multiserve.fleet.launch import Fleet, launch_fleet

pytestmark = pytest.mark.slow

CPU4 = Path(__file__).resolve().parents[2] / "configs" / "cpu-4.toml"
# One small bucket pair, the one test_fleet_tp.py's one-device fleet runs (so its programs
# come from the persistent compilation cache): what is tested here is the fleet (ports,
# devices, supervisor, faults), not the buckets; the shipped buckets run in
# test_fleet_validate.py (configs/cpu-4.toml as it is) and scripts/fleet.sh.
TEST_OVERRIDES = {"fleet.base_port": 0, "fleet.supervisor_port": 0, "fleet.warmup": "parallel",
                  "engine.max_total_tokens": 4096, "engine.show_progress": False,
                  "engine.precompile_token_paddings": [64], "engine.precompile_bs_paddings": [8],
                  "engine.chunked_prefill_size": 64, "engine.max_running_requests": 8}
PROMPT = "What is the capital of France?"
STREAM_TOKENS = 12


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = launch_fleet(load_fleet_config(CPU4, TEST_OVERRIDES), announce=False)
    # The pause tests stop 4 short streams mid-way: they need the 4 engines at the same
    # speed, i.e. every program compiled (with one bucket pair, READY already means that).
    for w in f.workers:
        assert w.wait_compiled(600)
    yield f
    f.stop("abort")


def client(fleet: Fleet, i: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fleet.urls[i]}/v1", api_key="none", max_retries=0,
                              timeout=120)


async def chat(fleet: Fleet, i: int, max_tokens: int = 12, ignore_eos: bool = False) -> Any:
    async with client(fleet, i) as c:
        return await c.chat.completions.create(
            model=fleet.workers[i].model_name, messages=[{"role": "user", "content": PROMPT}],
            temperature=0, max_tokens=max_tokens,
            extra_body={"ignore_eos": True} if ignore_eos else None)


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> str:
    """The undisturbed greedy answer (STREAM_TOKENS tokens, EOS ignored) from engine 0."""
    with openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="none", max_retries=0) as c:
        resp = c.chat.completions.create(
            model=fleet.workers[0].model_name, messages=[{"role": "user", "content": PROMPT}],
            temperature=0, max_tokens=STREAM_TOKENS, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    return resp.choices[0].message.content


def sup(fleet: Fleet, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{fleet.supervisor_url}{path}", json=body, timeout=300)


def forward_counts(fleet: Fleet) -> list[int]:
    info = sup(fleet, "GET", "/get_server_info").json()
    return [s["forward_ct"] for s in info["internal_states"]]


def passes_settled(fleet: Fleet, passes: int = 2) -> list[dict]:
    """Every engine's internal state once its loop has completed `passes` more passes (each
    decides whether to step): by round trips, not by time."""
    def states() -> list[dict]:
        return sup(fleet, "GET", "/get_server_info").json()["internal_states"]
    start = [s["loop_passes"] for s in states()]
    while True:
        now = states()
        if all(s["loop_passes"] >= p + passes for s, p in zip(now, start, strict=True)):
            return now


# --- serving ---------------------------------------------------------------------------------

def test_ready_line_names_every_port_and_device(fleet: Fleet) -> None:
    line = fleet.ready_line()
    assert line.startswith("READY: servers=4 ports=[")
    assert "devices=[[0],[1],[2],[3]]" in line
    assert len(set(fleet.ports)) == 4 and 0 not in fleet.ports
    for url in [*fleet.urls, fleet.supervisor_url]:
        assert httpx.get(f"{url}/health").status_code == 200


async def test_sixteen_concurrent_openai_clients_get_identical_greedy_answers(
        fleet: Fleet) -> None:
    before = forward_counts(fleet)
    t0 = time.monotonic()
    answers = await asyncio.gather(*(chat(fleet, k % 4) for k in range(16)))
    wall = time.monotonic() - t0
    texts = [a.choices[0].message.content for a in answers]
    assert all(texts), texts
    assert len(set(texts)) == 1, texts
    assert "Paris" in texts[0]
    after = forward_counts(fleet)
    assert all(a > b for a, b in zip(after, before, strict=True))  # every engine worked
    print(f"16 requests over 4 engines in {wall:.2f} s: {texts[0]!r}")


def test_each_engine_arrays_live_only_on_its_own_device(fleet: Fleet) -> None:
    import jax

    owned: list[list[jax.Array]] = []
    for w in fleet.workers:
        params, kv = w.engine.call(Call(lambda core: (core.runner.params,
                                                      core.runner.kv))).result()
        leaves = [x for x in jax.tree.leaves((params, kv)) if isinstance(x, jax.Array)]
        assert leaves
        mine = {jax.devices()[i] for i in w.device_indexes}
        for leaf in leaves:
            assert leaf.devices() <= mine, (w.index, leaf.shape, leaf.devices())
        owned.append(leaves)
    ids = [{id(x) for x in leaves} for leaves in owned]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not ids[i] & ids[j], f"engines {i} and {j} share an array"
    # Every live array of the process sits inside one engine's device group, and each
    # device holds at least a full copy of its engine's params + KV pool.
    per_device: dict[Any, int] = defaultdict(int)
    groups = [{jax.devices()[i] for i in w.device_indexes} for w in fleet.workers]
    for a in jax.live_arrays():
        devs = a.devices()
        assert any(devs <= g for g in groups), f"array {a.shape} spans {devs}"
        for d in devs:
            per_device[d] += a.nbytes // len(devs)
    need = sum(x.nbytes for x in owned[0])
    for g in groups:
        (d,) = g
        assert per_device[d] >= need, (d, per_device[d], need)


# --- supervisor pause while streaming ---------------------------------------------------------

async def _stream(fleet: Fleet, i: int, started: asyncio.Event) -> tuple[str, str | None]:
    text, finish, chunks = "", None, 0
    async with client(fleet, i) as c:
        stream = await c.chat.completions.create(
            model=fleet.workers[i].model_name, messages=[{"role": "user", "content": PROMPT}],
            temperature=0, max_tokens=STREAM_TOKENS, stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            chunks += 1
            if chunks >= 3:
                started.set()
    started.set()
    return text, finish


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_supervisor_pause_while_every_engine_streams(fleet: Fleet, reference: str,
                                                           mode: str) -> None:
    events = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(_stream(fleet, k, events[k])) for k in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    try:
        r = await asyncio.to_thread(sup, fleet, "POST", "/pause_generation", {"mode": mode})
        assert r.status_code == 200, r.text
        assert r.json()["success"] and len(r.json()["engines"]) == 4
        before = await asyncio.to_thread(forward_counts, fleet)
        # a paused engine's loop decides again and again not to step, and never spins
        settled = await asyncio.to_thread(passes_settled, fleet)
        assert [s["forward_ct"] for s in settled] == before
        assert all(s["empty_passes"] == 0 for s in settled)
        health = (await asyncio.to_thread(sup, fleet, "GET", "/health")).json()
        assert all(e["paused"] for e in health["engines"])
        if mode != "abort":
            assert not any(t.done() for t in tasks)  # paused streams wait, they do not end
    finally:
        r = await asyncio.to_thread(sup, fleet, "POST", "/continue_generation")
    assert r.status_code == 200, r.text
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for text, finish in results:
        if mode == "abort":
            assert finish == "abort"
            assert reference.startswith(text) and len(text) < len(reference)
        else:
            assert finish == "length"
            assert text == reference


# --- fault isolation and restart ---------------------------------------------------------------

async def test_fault_in_one_engine_isolated_and_restart_restores_it(fleet: Fleet,
                                                                    reference: str) -> None:
    broken = 1
    fleet.workers[broken].engine.call(InjectFault("boom: injected by test")).result()
    try:  # the next step of engine 1 raises; the request that triggers it ends in error
        resp = await chat(fleet, broken, 8)
        assert resp.choices[0].finish_reason == "abort"
    except openai.APIStatusError as e:
        assert e.status_code >= 500
    r = httpx.get(f"{fleet.urls[broken]}/health")
    assert r.status_code == 503 and "boom: injected by test" in r.text
    with pytest.raises(openai.APIStatusError) as err:
        await chat(fleet, broken)
    assert err.value.status_code == 503 and "boom: injected by test" in str(err.value)
    others = [i for i in range(4) if i != broken]
    answers = await asyncio.gather(*(chat(fleet, i, STREAM_TOKENS, ignore_eos=True)
                                     for i in others))
    assert [a.choices[0].message.content for a in answers] == [reference] * 3
    h = sup(fleet, "GET", "/health")
    assert h.status_code == 503
    assert [e["healthy"] for e in h.json()["engines"]] == [i != broken for i in range(4)]

    t0 = time.monotonic()
    r = await asyncio.to_thread(sup, fleet, "POST", "/restart_engine", {"engine": broken})
    print(f"restart took {time.monotonic() - t0:.1f} s")
    assert r.status_code == 200, r.text
    assert "boom: injected by test" in r.json()["previous_reason"]
    assert httpx.get(f"{fleet.urls[broken]}/health").status_code == 200
    assert sup(fleet, "GET", "/health").status_code == 200
    again = await chat(fleet, broken, STREAM_TOKENS, ignore_eos=True)
    assert again.choices[0].message.content == reference
    info = httpx.get(f"{fleet.urls[broken]}/get_server_info").json()
    assert info["device_indexes"] == [broken] and info["restart_count"] == 1


async def test_supervisor_release_and_resume_memory_across_the_fleet(fleet: Fleet,
                                                                      reference: str) -> None:
    r = sup(fleet, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["engines"]) == 4
    for url in fleet.urls:
        h = httpx.get(f"{url}/health", timeout=30)
        assert h.status_code == 200 and h.json()["status"] == "asleep", h.text
    r = sup(fleet, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 200, r.text
    outs = await asyncio.gather(*(chat(fleet, i, STREAM_TOKENS, ignore_eos=True)
                                  for i in range(4)))
    assert [o.choices[0].message.content for o in outs] == [reference] * 4
