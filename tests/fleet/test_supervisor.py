"""The supervisor app over two real engines on separate devices (ASGI, in process).

What is checked: fleet-wide control is a concurrent barrier with per-engine results
(200 only when every engine succeeded), health / info / metrics / models aggregate every
engine, bad bodies are 400 with an OpenAI-style error, and restart goes through the
launcher's callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from shipped_engine import SHIPPED_FUSED_STEP_MAX

from multiserve.config import EngineConfig, ModelConfig
from multiserve.engine.commands import InjectFault
from multiserve.fleet.supervisor import build_supervisor_app
from multiserve.types import ControlResult, EngineClient, GenerateRequest, SamplingParams

PORTS = [31000, 31001]
MAX_NEW = 300  # long enough that a stream is still running when a pause arrives
LONG = 4000  # a request that runs until it is aborted

TINY_MODEL = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
    bos_token_id=1, eos_token_ids=(2,))
TINY_ENGINE = dict(
    precompile_token_paddings=(64,), precompile_bs_paddings=(64,), max_running_requests=64,
    chunked_prefill_size=64, page_size=8, max_total_tokens=16384, max_context_len=4096,
    show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)


# --- engines ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def make_engine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Any]:
    """Builds a real Engine on one device: tiny random Llama, small CPU buckets."""
    from multiserve.engine.engine import Engine
    from multiserve.model.loading.default_model import default_model_path
    from multiserve.model.testing import init_random_params, save_hf_dir

    model_dir = save_hf_dir(tmp_path_factory.mktemp("tiny-supervisor"), TINY_MODEL,
                            init_random_params(TINY_MODEL, seed=3),
                            tokenizer_dir=default_model_path())

    def make(device: int) -> Any:
        return Engine(EngineConfig(model_path=str(model_dir), device_indexes=(device,),
                                   **TINY_ENGINE))
    return make


@pytest.fixture(scope="module")
def engines(make_engine: Callable[[int], Any]) -> Iterator[list[Any]]:
    built = [make_engine(d) for d in range(len(PORTS))]
    yield built
    for e in built:
        e.shutdown()


# --- helpers ---------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
async def leave_engines_running_and_empty(engines: list[Any]) -> AsyncIterator[None]:
    yield
    for e in engines:  # the engines are shared by the whole module
        await e.acontrol("continue_generation")
        await e.acontrol("abort_request", abort_all=True)


@pytest.fixture
async def client(engines: list[Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with supervisor_client(engines) as c:
        yield c


def request(rid: str, prompt: list[int], max_new: int = MAX_NEW) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), stream=True, sampling=SamplingParams(
        max_new_tokens=max_new, temperature=0.0, ignore_eos=True))


class Stream:
    """Consumes one engine stream in a task; `started` is set once tokens flow."""

    def __init__(self, engine: EngineClient, req: GenerateRequest, min_tokens: int = 2) -> None:
        self.started = asyncio.Event()
        self.last: Any = None
        self.task = asyncio.create_task(self._run(engine, req, min_tokens))

    async def _run(self, engine: EngineClient, req: GenerateRequest, min_tokens: int) -> Any:
        async for out in engine.stream(req):
            self.last = out
            if len(out.output_ids) >= min_tokens or out.finished:
                self.started.set()
        return self.last


PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6, 8, 10, 12, 14]]


async def reference(engine: EngineClient) -> list[tuple[int, ...]]:
    outs = await asyncio.gather(*(Stream(engine, request(f"ref{j}", p)).task
                                  for j, p in enumerate(PROMPTS)))
    return [o.output_ids for o in outs]


async def state(engine: EngineClient) -> dict[str, Any]:
    return await engine.acontrol("get_internal_state")


async def passes_settled(engine: EngineClient, passes: int = 2) -> dict[str, Any]:
    """The engine's state once its loop has completed `passes` more passes (each decides
    whether to step): by round trips, not by time."""
    start = (await state(engine))["loop_passes"]
    while True:
        now = await state(engine)
        if now["loop_passes"] >= start + passes:
            return now


# --- tests -----------------------------------------------------------------------------------

async def test_idle_fleet_health_info_models_metrics(client: httpx.AsyncClient,
                                                     engines: list[Any]) -> None:
    r = await client.get("/health")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["healthy"] is True
    assert [(e["engine"], e["port"], e["healthy"], e["paused"], e["running"], e["waiting"])
            for e in body["engines"]] == [(0, 31000, True, False, 0, 0),
                                          (1, 31001, True, False, 0, 0)]

    r = await client.get("/get_server_info")
    assert r.status_code == 200
    info = r.json()
    assert info["num_engines"] == 2 and len(info["internal_states"]) == 2
    for s in info["internal_states"]:
        assert s["engine_paused"] is False and s["waiting_queue_size"] == 0
    # what the fleet holds: each engine's weights, KV pool and programs, summed
    memories = [s["memory"] for s in info["internal_states"]]
    total = info["memory"]["engines_total"]
    for key in ("weights_bytes", "kv_pool_bytes", "kv_pool_tokens"):
        assert total[key] == sum(m[key] for m in memories) > 0, key
    assert total["kv_pool_tokens"] == 2 * TINY_ENGINE["max_total_tokens"]
    assert total["programs_count"] == sum(m["programs"]["count"] for m in memories) > 0
    process = info["memory"]["process"]
    assert process["peak_rss_bytes"] >= process["rss_bytes"] > total["weights_bytes"]

    r = await client.get("/v1/models")
    assert r.status_code == 200
    (model,) = r.json()["data"]
    assert model["id"] == engines[0].model_name and model["engines"] == [0, 1]
    assert model["max_model_len"] == engines[0].context_len

    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for i, port in enumerate(PORTS):
        labels = f'engine="{i}",port="{port}"'
        assert f"multiserve_fleet_engine_healthy{{{labels}}} 1.0" in text
        assert f"multiserve_fleet_engine_paused{{{labels}}} 0.0" in text
        assert f"multiserve_fleet_num_running_reqs{{{labels}}} 0.0" in text
        weight = (f'multiserve_fleet_engine_weight_info{{engine="{i}",'
                  f'model="{engines[i].model_name}",port="{port}",weight_version="')
        assert weight in text
    assert "multiserve_fleet_engines 2.0" in text


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_is_a_fleet_barrier_and_continue_resumes(
        client: httpx.AsyncClient, engines: list[Any], mode: str) -> None:
    refs = [await reference(e) for e in engines]
    streams = [[Stream(e, request(f"{mode}-{i}-{j}", p)) for j, p in enumerate(PROMPTS)]
               for i, e in enumerate(engines)]
    await asyncio.gather(*(s.started.wait() for row in streams for s in row))

    r = await client.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True
    assert [(e["engine"], e["port"], e["success"]) for e in body["engines"]] == [
        (0, 31000, True), (1, 31001, True)]

    # every engine is quiescent once the supervisor answered: no step runs
    before = [await state(e) for e in engines]
    assert all(s["engine_paused"] for s in before)
    after = [await passes_settled(e) for e in engines]  # each loop decided not to step
    assert [s["forward_ct_decode"] for s in after] == [s["forward_ct_decode"] for s in before]
    assert all(s["empty_passes"] == 0 for s in after)  # and never spun
    if mode == "retract":
        assert all(s["running_batch_size"] == 0 and s["waiting_queue_size"] == len(PROMPTS)
                   for s in after)
    if mode == "in_place":
        assert all(s["running_batch_size"] == len(PROMPTS) for s in after)

    health = (await client.get("/health")).json()
    assert all(e["paused"] is True for e in health["engines"])

    r = await client.post("/continue_generation")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    for i, row in enumerate(streams):
        outs = await asyncio.gather(*(s.task for s in row))
        for out, ref in zip(outs, refs[i], strict=True):
            if mode == "abort":
                assert out.finish_reason == "abort"
                assert 0 < len(out.output_ids) < MAX_NEW
                assert out.output_ids == ref[:len(out.output_ids)]
            else:
                assert out.finish_reason == "length" and out.output_ids == ref


async def test_pausing_a_paused_fleet_and_continuing_a_running_one_are_noops(
        client: httpx.AsyncClient) -> None:
    r = await client.post("/continue_generation", json={})
    assert r.status_code == 200 and r.json()["success"] is True
    for _ in range(2):
        r = await client.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200 and r.json()["success"] is True


async def test_partial_failure_is_an_error_with_per_engine_detail(
        client: httpx.AsyncClient, engines: list[Any]) -> None:
    busy = Stream(engines[0], request("busy", PROMPTS[0], max_new=LONG))
    await busy.started.wait()
    r = await client.post("/flush_cache")
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and "engine 0" in body["message"]
    e0, e1 = body["engines"]
    assert (e0["engine"], e0["success"]) == (0, False) and e0["message"]
    assert (e1["engine"], e1["success"]) == (1, True)

    r = await client.post("/abort_request", json={"rid": "busy"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert (await busy.task).finish_reason == "abort"
    assert r.json()["aborted"] == 1
    r = await client.post("/abort_request", json={"rid": "no-such-request"})
    assert r.status_code == 200, r.text  # reported, not an error (docs/architecture.md §5)
    assert r.json()["aborted"] == 0 and "no engine has a live request" in r.json()["message"]
    r = await client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text


async def test_abort_all_ends_every_engines_requests(client: httpx.AsyncClient,
                                                     engines: list[Any]) -> None:
    streams = [Stream(e, request(f"all-{i}", PROMPTS[1], max_new=LONG))
               for i, e in enumerate(engines)]
    await asyncio.gather(*(s.started.wait() for s in streams))
    r = await client.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json()["success"] is True
    assert [(await s.task).finish_reason for s in streams] == ["abort", "abort"]


class _Hooked:
    """A real engine whose control calls first run `hook` (to raise, stall or meet a
    barrier): stands in for a broken or slow worker hand-off in front of the engine."""

    def __init__(self, inner: EngineClient, hook: Callable[[], Any]) -> None:
        self.inner, self.hook = inner, hook
        self.model_name, self.context_len = inner.model_name, inner.context_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        if name != "get_internal_state":
            await self.hook()
        return await self.inner.acontrol(name, **args)


def supervisor_client(fleet: list[Any], **kwargs: Any) -> httpx.AsyncClient:
    app = build_supervisor_app(fleet, engine_ports=PORTS, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s")


async def test_an_engine_that_raises_is_reported_not_fatal(engines: list[Any]) -> None:
    async def boom() -> None:
        raise RuntimeError("worker queue is gone")

    async with supervisor_client([engines[0], _Hooked(engines[1], boom)]) as c:
        r = await c.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 500
        e0, e1 = r.json()["engines"]
        assert e0["success"] is True and e1["success"] is False
        assert "RuntimeError: worker queue is gone" in e1["message"]
        assert (await c.get("/health")).status_code == 200  # the supervisor still serves
        r = await c.post("/continue_generation")
        assert r.status_code == 500 and r.json()["engines"][0]["success"] is True
    assert (await state(engines[0]))["engine_paused"] is False


async def test_broadcast_reaches_engines_concurrently(engines: list[Any]) -> None:
    # each engine's call waits until every engine's call has started: a sequential
    # broadcast would never get past the first engine (and time out)
    barrier = asyncio.Barrier(len(engines))

    async def meet() -> None:
        await barrier.wait()

    async with supervisor_client([_Hooked(e, meet) for e in engines],
                                 control_timeout=5.0) as c:
        r = await c.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200, r.text
        r = await c.post("/continue_generation")
        assert r.status_code == 200, r.text


async def test_an_engine_that_never_answers_times_out_with_detail(engines: list[Any]) -> None:
    async def stall() -> None:
        await asyncio.Event().wait()

    async with supervisor_client([engines[0], _Hooked(engines[1], stall)],
                                 control_timeout=0.5) as c:
        r = await c.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 504
        e0, e1 = r.json()["engines"]
        assert e0["success"] is True and "no answer within 0.5 s" in e1["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/pause_generation", {"mdoe": "retract"}, "mdoe"),
    ("/pause_generation", {"mode": 1}, "mode"),
    ("/continue_generation", {"now": True}, "now"),
    ("/abort_request", {}, "rid"),
    ("/abort_request", {"rid": "x", "abort_all": True}, "rid"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/restart_engine", {"engine": 2}, "engine"),
    ("/restart_engine", {"engine": "1"}, "engine"),
    ("/restart_engine", {}, "engine"),
])
async def test_invalid_bodies_are_400_and_touch_no_engine(
        client: httpx.AsyncClient, engines: list[Any], path: str, body: dict[str, Any],
        param: str) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # the engines' error object (server/http_utils.parse_body, errors.bad_request)
    assert err["param"] == param and err["type"] == "BadRequestError"
    assert err["code"] == "invalid_request_error" and param in err["message"]
    assert [(await state(e))["engine_paused"] for e in engines] == [False, False]


async def test_non_json_body_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/pause_generation", content=b"{mode: abort",
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = await client.post("/pause_generation", json=["abort"])
    assert r.status_code == 400


async def test_fault_is_isolated_and_restart_rebuilds_the_engine(
        engines: list[Any], make_engine: Callable[[int], Any]) -> None:
    fleet = engines  # the module's list: the rebuilt engine replaces the faulted one
    calls: list[int] = []

    async def restart(i: int) -> ControlResult:
        calls.append(i)
        old = fleet[i]
        fleet[i] = await asyncio.to_thread(make_engine, i)
        await asyncio.to_thread(old.shutdown)
        return ControlResult(True, f"engine {i} rebuilt")

    async with supervisor_client(fleet, restart=restart) as c:
        victim = Stream(fleet[1], request("victim", PROMPTS[0], max_new=LONG))
        await victim.started.wait()
        fleet[1].call(InjectFault("boom in step")).result()
        assert (await victim.task).finish_reason == "abort"
        r = await c.get("/health")
        assert r.status_code == 503
        e0, e1 = r.json()["engines"]
        assert e0["healthy"] is True and e1["healthy"] is False
        assert "boom in step" in e1["reason"]
        assert 'multiserve_fleet_engine_healthy{engine="1",port="31001"} 0.0' in (
            await c.get("/metrics")).text

        old = fleet[1]
        r = await c.post("/restart_engine", json={"engine": 1})
        assert r.status_code == 200, r.text
        assert {"success": True, "engine": 1, "port": 31001}.items() <= r.json().items()
        assert calls == [1] and fleet[1] is not old
        assert (await c.get("/health")).status_code == 200
        assert 'multiserve_fleet_engine_restarts_total{engine="1",port="31001"} 1.0' in (
            await c.get("/metrics")).text
        # the rebuilt engine serves, with the same greedy answers as its sibling
        assert await reference(fleet[1]) == await reference(fleet[0])

    # a shut-down engine's calls fail with EngineUnavailable: reported as 503 per engine
    async with supervisor_client([fleet[0], old]) as c:
        r = await c.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 503
        assert "engine unavailable" in r.json()["engines"][1]["message"]


async def test_restart_without_a_callback_is_501(client: httpx.AsyncClient) -> None:
    r = await client.post("/restart_engine", json={"engine": 0})
    assert r.status_code == 501 and r.json()["success"] is False
