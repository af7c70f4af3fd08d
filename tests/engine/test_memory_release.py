"""Memory release / resume (issue 7): what is freed, that nothing is lost, exact resumption.

One tiny engine of its own on device 3 (the shared tiny engines live on device 0, and
"the engine's devices hold none of its buffers" is measured per device). Release points
are exact: a sink hook (`AtTokens`) queues the call when a request has k tokens.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger, assert_idle_and_clean

from multiserve.types import SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                        return_logprob=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=77, max_new_tokens=MAX_NEW,
                         ignore_eos=True, return_logprob=True)
DEVICE = 3


def _prompts(seed: int = 0, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 60))]
            for _ in range(n)]


def _params(i: int) -> SamplingParams:
    return GREEDY if i % 2 == 0 else SAMPLED.with_updates(seed=77 + i)


def _live_on(devices: list[Any], ignore: set[int]) -> list[Any]:
    return [a for a in jax.live_arrays()
            if id(a) not in ignore and any(d in devices for d in a.devices())]


@pytest.fixture(scope="module")
def sleepy(_tiny_engine: Any) -> Iterator[Any]:
    """The shared tiny engine's exact config (same compiled shapes), on its own device."""
    from multiserve.engine.engine import Engine

    dev = jax.devices()[DEVICE]
    before = {id(a) for a in _live_on([dev], set())}
    eng = Engine(_tiny_engine.config.with_updates(device_indexes=(DEVICE,)))
    eng.foreign_arrays = before  # arrays on the device that are not this engine's
    yield eng
    eng.shutdown()


@pytest.fixture
def engine(sleepy: Any) -> Iterator[Any]:
    yield sleepy
    sleepy.resume_memory_occupation()
    sleepy.continue_generation()
    sleepy.abort_request(abort_all=True)
    assert_idle_and_clean(sleepy)


@pytest.fixture(scope="module")
def reference(sleepy: Any) -> dict:
    """Uninterrupted outputs of the workload (greedy and seeded rows, with logprobs)."""
    col = Collector(sleepy)
    col.submit_all(_prompts(), [_params(i) for i in range(6)])
    return col.wait()


def _run_with_hook(engine: Any, trigger: Trigger, k: int, *factories: Any
                   ) -> tuple[Collector, AtTokens]:
    hook = AtTokens(trigger, "r0", k, *factories)
    col = Collector(engine, on_output=hook)
    col.submit_all(_prompts(), [_params(i) for i in range(6)])
    return col, hook


def test_release_frees_every_device_buffer_and_resume_restores(engine: Any,
                                                               reference: dict) -> None:
    misses = engine.get_internal_state()["cache_miss_count"]
    assert _live_on(engine.devices, engine.foreign_arrays)
    rel = engine.release_memory_occupation()
    assert rel.ok and rel.details["released"] == ["weights", "kv_cache"], rel
    assert rel.details["host_bytes"] > 0
    assert _live_on(engine.devices, engine.foreign_arrays) == []
    healthy, reason = engine.health()
    assert healthy and reason.startswith("asleep"), reason
    st = engine.get_internal_state()
    assert st["memory_released"] == ["kv_cache", "weights"] and st["engine_paused"]
    host = [weakref.ref(a) for a in jax.tree.leaves(engine._control_runner.memory.host_params)]
    again = engine.release_memory_occupation()
    assert again.ok and again.details["already_released"] and "no-op" in again.message
    assert engine.flush_cache().ok  # host-only bookkeeping: allowed, touches no device
    assert _live_on(engine.devices, engine.foreign_arrays) == []

    res = engine.resume_memory_occupation()
    assert res.ok and res.details["resumed"] == ["weights", "kv_cache"], res
    assert res.details["continued"]
    assert res.details["host_bytes_freed"] == rel.details["host_bytes"]
    gc.collect()
    # The engine keeps no host copy: each one is freed, or (CPU) adopted as the device buffer.
    assert engine._control_runner.memory.host_params is None
    device_ptrs = {a.unsafe_buffer_pointer()
                   for a in jax.tree.leaves(engine._core.runner.held_params)}
    for r in host:
        assert r() is None or r().ctypes.data in device_ptrs
    assert engine.resume_memory_occupation().details["already_resident"]
    assert engine.health() == (True, "ok")
    col = Collector(engine)
    col.submit_all(_prompts(), [_params(i) for i in range(6)])
    for key, out in col.wait().items():
        assert out.output_ids == reference[key].output_ids
        assert out.logprobs == reference[key].logprobs  # the same weights, bit for bit
    assert engine.get_internal_state()["cache_miss_count"] == misses


def test_request_sent_while_released_waits_then_completes(engine: Any, reference: dict) -> None:
    engine.release_memory_occupation()
    s1 = engine.get_internal_state()
    col = Collector(engine)
    col.submit("r0", _prompts()[0], _params(0))
    assert engine.continue_generation().message.startswith("continued; memory is released")
    s2 = engine.get_internal_state()  # a command round trip: the loop ran, no step did
    assert s2["waiting_rids"] == ["r0"] and s2["forward_ct"] == s1["forward_ct"]
    assert not col.snapshots
    assert engine.resume_memory_occupation().ok
    assert col.wait()[("r0", 0)].output_ids == reference[("r0", 0)].output_ids


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_release_with_requests_in_flight_loses_nothing(engine: Any, trigger: Trigger,
                                                       reference: dict, mode: str) -> None:
    col, hook = _run_with_hook(engine, trigger, 6,
                               lambda: engine.acontrol("release_memory_occupation", mode=mode))
    (res,) = hook.wait()
    assert res.ok and res.details["pause"]["mode"] == mode, res
    assert _live_on(engine.devices, engine.foreign_arrays) == []
    st = engine.get_internal_state()
    if mode != "abort":
        assert st["waiting_queue_size"] + st["running_batch_size"] > 0
        assert st["running_batch_size"] == 0  # K/V not preserved: holders were retracted
    assert engine.resume_memory_occupation().details["continued"]
    got = col.wait()
    assert set(got) == set(reference)  # every request has exactly one final output
    for key, out in got.items():
        want = reference[key].output_ids
        if mode == "abort":
            assert out.finish_reason == "abort" and want[:len(out.output_ids)] == \
                out.output_ids and len(out.logprobs) == len(out.output_ids)
        else:
            assert out.output_ids == want and out.finish_reason == "length", key


def test_preserve_state_resumes_bit_identically(engine: Any, trigger: Trigger,
                                                reference: dict) -> None:
    retractions = engine.get_internal_state()["num_retractions"]
    col, hook = _run_with_hook(
        engine, trigger, 7,
        lambda: engine.acontrol("release_memory_occupation", mode="in_place",
                               preserve_state=True))
    (res,) = hook.wait()
    assert res.ok and res.details["preserved_requests"] > 0, res
    assert _live_on(engine.devices, engine.foreign_arrays) == []
    assert engine.get_internal_state()["running_batch_size"] == \
        res.details["preserved_requests"]
    res = engine.resume_memory_occupation()
    assert res.ok and res.details["restored_kv_pages"] > 0
    got = col.wait()
    for key, out in got.items():
        assert out.output_ids == reference[key].output_ids, key
        assert out.logprobs == reference[key].logprobs, key  # bit-identical continuation
    assert engine.get_internal_state()["num_retractions"] == retractions


def test_tags_release_and_resume_separately(engine: Any, reference: dict) -> None:
    held = engine.get_internal_state()["memory"]
    res = engine.release_memory_occupation(tags=["kv_cache"])
    assert res.details["released"] == ["kv_cache"]
    mem = engine.get_internal_state()["memory"]  # what it holds now: the weights alone
    assert (mem["kv_pool_bytes"], mem["released"]) == (0, ["kv_cache"])
    assert mem["weights_bytes"] == held["weights_bytes"] > 0
    # weights only: the params and their transposed copies (tied head: an alias of embed)
    runner = engine._core.runner  # the held canonical leaves + the compute layouts
    n_params = len({id(a) for a in jax.tree.leaves((runner.held_params,
                                                    runner.compute_params))})
    assert len(_live_on(engine.devices, engine.foreign_arrays)) == n_params
    assert engine.get_weights_by_name("model.norm.weight", 4).details["from"] == "device"
    res = engine.release_memory_occupation(tags="weights")
    assert res.details["released"] == ["weights"]
    mem = engine.get_internal_state()["memory"]
    assert (mem["weights_bytes"], mem["released"]) == (0, ["weights", "kv_cache"])
    assert _live_on(engine.devices, engine.foreign_arrays) == []
    read = engine.get_weights_by_name("model.norm.weight", 4)
    assert read.ok and read.details["from"].startswith("host copy")
    refused = engine.update_weights_from_tensor({}, "v-x")
    assert not refused.ok and "weights are released" in refused.message
    col = Collector(engine)
    col.submit("r0", _prompts()[0], _params(0))
    res = engine.resume_memory_occupation(tags=["kv_cache"])
    assert res.ok and "still asleep" in res.message and not res.details["continued"]
    assert engine.get_internal_state()["waiting_rids"] == ["r0"]
    res = engine.resume_memory_occupation(tags=["weights"])
    assert res.ok and res.details["continued"]
    assert col.wait()[("r0", 0)].output_ids == reference[("r0", 0)].output_ids
    with pytest.raises(ValueError, match="tags: unknown tag 'gpu'"):
        engine.release_memory_occupation(tags=["gpu"])


def test_release_drops_a_staged_update_and_its_hold(engine: Any, tiny_model_dir: Path) -> None:
    staged = engine.stage_weights_from_disk(str(tiny_model_dir), "next")
    assert staged.ok and engine.get_internal_state()["engine_paused"]  # held for publish
    rel = engine.release_memory_occupation()
    assert rel.ok and rel.details["discarded_staged_weights"], rel
    assert _live_on(engine.devices, engine.foreign_arrays) == []  # staged copy freed too
    assert engine.resume_memory_occupation().details["continued"]  # the hold is not leaked
    assert not engine.get_internal_state()["engine_paused"]
    res = engine.publish_staged_weights(staged.details["token"])
    assert not res.ok and "no staged weights" in res.message
    assert engine.get_internal_state()["weight_version"] == "default"


async def test_http_release_resume_routes(engine: Any, tokenizer_dir_tiny: Path) -> None:
    from multiserve.server.app import build_app
    from multiserve.server.control_routes import add_rl_routes
    from multiserve.server.tokenizer import TokenizerManager

    app = build_app(engine, TokenizerManager(tokenizer_dir_tiny, context_len=1024,
                                             model_name="tiny"))
    add_rl_routes(app, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://engine") as http:
        r = await http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 200 and r.json()["released"] == ["kv_cache"], r.text
        info = (await http.get("/get_server_info")).json()
        assert info["memory_released"] == ["kv_cache"]
        r = await http.post("/release_memory_occupation", json={"tags": ["cpu"]})
        assert r.status_code == 400 and "unknown tag 'cpu'" in r.text
        r = await http.post("/release_memory_occupation", json={"mode": "nap"})
        assert r.status_code == 400 and "mode" in r.text
        r = await http.post("/resume_memory_occupation")
        assert r.status_code == 200 and r.json()["resumed"] == ["kv_cache"], r.text
        assert (await http.get("/get_server_info")).json()["memory_released"] == []


@pytest.fixture(scope="module")
def tokenizer_dir_tiny(tiny_model_dir: Path) -> Path:
    return tiny_model_dir
