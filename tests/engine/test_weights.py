"""Weight updates (issue 7): validated, staged, atomic, versioned, without recompiles; the
per-engine HTTP routes and the supervisor's all-or-nothing fleet update.

Runs on the shared tiny engines; the `engine` fixture puts the original weights (version
"default", read back from the model dir) back after every test, and the first test
proves that this restores the original outputs bit for bit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger

from multiserve.engine.commands import Call
from multiserve.types import ControlResult, SamplingParams, WeightSegment

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                        return_logprob=True)
Q0 = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


def _prompts(seed: int = 1, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 50))]
            for _ in range(n)]


def _run(engine: Any, prompts: list[list[int]] | None = None,
         params: SamplingParams = GREEDY) -> dict:
    col = Collector(engine)
    col.submit_all(prompts or _prompts(), params)
    return col.wait()


def _ids(outs: dict) -> dict:
    return {k: o.output_ids for k, o in outs.items()}


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path) -> tuple[Any, dict]:
    """(model config, the original params as numpy): what a trainer would hold."""
    from multiserve.model.loading.loader import load_model

    loaded = load_model(str(tiny_model_dir), np.float32)
    return loaded.config, loaded.params


def perturbed(params: dict, seed: int, scale: float = 0.3) -> dict:
    rng = np.random.default_rng(seed)

    def f(a: np.ndarray) -> np.ndarray:
        return (a * (1 + scale * rng.standard_normal(a.shape))).astype(np.float32)

    return {k: ({kk: f(vv) for kk, vv in v.items()} if k == "layers" else f(v))
            for k, v in params.items()}


def _restore(engine: Any, model_dir: Path) -> None:
    engine.discard_staged_weights()
    engine.continue_generation()
    engine.abort_request(abort_all=True)
    if engine.get_internal_state()["weight_version"] != "default":
        res = engine.update_weights_from_disk(str(model_dir), "default")
        assert res.ok, res


@pytest.fixture
def engine(tiny_engine: Any, tiny_model_dir: Path) -> Iterator[Any]:
    yield tiny_engine
    _restore(tiny_engine, tiny_model_dir)


@pytest.fixture(scope="module")
def before(_tiny_engine: Any) -> dict:
    """Outputs of the original weights (computed before any update in this module)."""
    assert _tiny_engine.get_internal_state()["weight_version"] == "default"
    return _run(_tiny_engine)


def test_update_changes_outputs_without_recompiling_and_restores_exactly(
        engine: Any, original: tuple, before: dict, tiny_model_dir: Path) -> None:
    cfg, params = original
    misses = engine.get_internal_state()["cache_miss_count"]
    p1 = perturbed(params, 1)
    res = engine.update_weights_from_tensor(p1, "v1")
    assert res.ok and res.details["previous_weight_version"] == "default", res
    after = _run(engine)
    changed = sum(after[k].output_ids != before[k].output_ids for k in before)
    assert changed >= len(before) - 1, "outputs did not follow the new weights"
    for out in after.values():
        assert out.weight_version == "v1"
        assert out.weight_segments == (WeightSegment(0, "v1"),)
    read = engine.get_weights_by_name(DOWN1, truncate_size=3)
    assert read.ok and read.details["shape"] == [64, 128] and read.details["truncated"]
    np.testing.assert_array_equal(np.asarray(read.details["values"], np.float32),
                                  p1["layers"]["w_down"][1].T[:3])
    assert engine.get_internal_state()["cache_miss_count"] == misses
    res = engine.update_weights_from_disk(str(tiny_model_dir), "default")
    assert res.ok and res.details["tensors"] == 21, res
    again = _run(engine)
    for k, out in before.items():  # bit for bit: ids and logprobs
        assert again[k].output_ids == out.output_ids and again[k].logprobs == out.logprobs
    assert engine.get_internal_state()["cache_miss_count"] == misses


def test_invalid_update_changes_nothing_and_names_the_tensor(
        engine: Any, original: tuple, before: dict, tmp_path: Path) -> None:
    from multiserve.model.loading.hf_names import params_to_hf
    from multiserve.model.loading.loader import save_hf_dir

    cfg, params = original
    good = params_to_hf(perturbed(params, 2), cfg)
    last = list(good)[-1]
    cases = {
        "shape": ({**good, DOWN1: np.zeros((3, 3), np.float32)}, f"'{DOWN1}': shape (3, 3)"),
        "dtype": ({**good, last: good[last].astype(np.int32)}, f"'{last}': dtype int32"),
        "name": ({**good, "model.layers.9.mlp.up_proj.weight": good[DOWN1]},
                 "'model.layers.9.mlp.up_proj.weight': not a parameter"),
        "nan": ({**good, last: np.full_like(good[last], np.nan)}, "NaN or inf"),
        # finite as given, inf once cast to the engine's float32: the placed arrays' check
        "overflow": ({**good, last: np.full(good[last].shape, 1e300, np.float64)},
                     "NaN or inf values (after the cast to float32)"),
        "tree": ({"layers": {"wq": params["layers"]["wq"][:, :3]}}, "'layers/wq': shape"),
    }
    for name, (tensors, needle) in cases.items():
        res = engine.update_weights_from_tensor(tensors, f"bad-{name}")
        assert not res.ok and needle in res.message, (name, res.message)
        st = engine.get_internal_state()
        assert st["weight_version"] == "default" and not st["engine_paused"], name
    bad_dir = tmp_path / "bad"
    save_hf_dir(bad_dir, cfg, perturbed(params, 3))
    from multiserve.model.loading import safetensors_io
    named = safetensors_io.load_file(bad_dir / "model.safetensors")
    named = {k: np.array(v) for k, v in named.items()}
    named[Q0] = named[Q0][:, :5]
    safetensors_io.save_file(named, bad_dir / "model.safetensors")
    res = engine.update_weights_from_disk(str(bad_dir), "bad-disk")
    assert not res.ok and f"'{Q0}': shape (64, 5)" in res.message and str(bad_dir) in \
        res.message, res.message
    raw = json.loads((bad_dir / "config.json").read_text())
    (bad_dir / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    res = engine.update_weights_from_disk(str(bad_dir), "bad-config")
    assert not res.ok and "num_layers is 3" in res.message, res.message
    res = engine.update_weights_from_disk(str(tmp_path / "nowhere"), "bad-path")
    assert not res.ok and "not a directory" in res.message
    assert _ids(_run(engine)) == _ids(before)


def test_update_refused_while_running_unless_aborted(engine: Any, trigger: Trigger,
                                                     original: tuple, before: dict) -> None:
    p1 = perturbed(original[1], 1)
    hook = AtTokens(trigger, "r0", 4,
                    lambda: engine.acontrol("update_weights_from_tensor", params=p1,
                                           weight_version="v1"))
    col = Collector(engine, on_output=hook)
    col.submit_all(_prompts(), GREEDY)
    (res,) = hook.wait()
    assert not res.ok and res.details["refused"] == "running", res
    assert "pause_generation" in res.message and "abort_running" in res.message
    assert _ids(col.wait()) == _ids(before)  # the refused update touched nothing

    hook = AtTokens(trigger, "r0", 4, lambda: engine.acontrol(
        "update_weights_from_tensor", params=p1, weight_version="v1", abort_running=True))
    col = Collector(engine, on_output=hook)
    col.submit_all(_prompts(), GREEDY)
    (res,) = hook.wait()
    assert res.ok and res.details["aborted"] == len(before), res
    for key, out in col.wait().items():
        want = before[key].output_ids
        assert out.finish_reason == "abort" and want[:len(out.output_ids)] == out.output_ids
    assert engine.get_internal_state()["weight_version"] == "v1"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_update_while_paused_records_segments(engine: Any, trigger: Trigger, original: tuple,
                                              before: dict, mode: str) -> None:
    p1 = perturbed(original[1], 1)
    hook = AtTokens(trigger, "r0", 5, lambda: engine.acontrol("pause_generation", mode=mode))
    col = Collector(engine, on_output=hook)
    col.submit_all(_prompts(), GREEDY)
    hook.wait()
    at_pause = {k: col.num_tokens(*k) for k in before}
    res = engine.update_weights_from_tensor(p1, "v1")
    assert res.ok, res
    if mode == "in_place":  # K/V kept; the prefix cache is off while it lives
        assert res.details["kept_kv_requests"] > 0 and not res.details["prefix_cache_enabled"]
    else:
        assert res.details["kept_kv_requests"] == 0 and res.details["prefix_cache_enabled"]
    assert engine.continue_generation().ok
    got = col.wait()
    prompts = _prompts()
    for i, (key, out) in enumerate(sorted(got.items())):
        n = at_pause[key]
        assert out.finish_reason == "length" and out.weight_version == "v1"
        assert len(out.logprobs) == MAX_NEW
        if n == MAX_NEW:
            continue
        assert out.weight_segments == ((WeightSegment(0, "default"),) if n else ()) + (
            WeightSegment(n, "v1"),)
        assert out.output_ids[:n] == before[key].output_ids[:n]
        if mode == "retract" and i == 0:  # re-prefilled with v1: v1's own continuation
            cont = _run(engine, [prompts[0] + list(out.output_ids[:n])],
                        GREEDY.with_updates(max_new_tokens=MAX_NEW - n))
            assert cont[("r0", 0)].output_ids == out.output_ids[n:]
    assert engine.call(Call(lambda core: core.cache.enabled)).result()


def test_partial_update_and_two_phase(engine: Any, original: tuple, tmp_path: Path) -> None:
    from multiserve.model.loading.loader import save_hf_dir

    cfg, params = original
    new_q0 = (params["layers"]["wq"][0].T * 2).astype(np.float32)
    res = engine.update_weights_from_tensor({Q0: new_q0}, "partial")
    assert res.ok and res.details["tensors"] == 1, res
    read = engine.get_weights_by_name(Q0, 2).details["values"]
    np.testing.assert_array_equal(np.asarray(read, np.float32), new_q0[:2])
    other = engine.get_weights_by_name(Q0.replace("layers.0", "layers.1"), 2)
    np.testing.assert_array_equal(np.asarray(other.details["values"], np.float32),
                                  params["layers"]["wq"][1].T[:2])
    # the engine's whole params are those of a full update with the same values, bit for
    # bit (the leaves held only as panels rebuilt, updated and packed again exactly)
    wq = np.array(params["layers"]["wq"], np.float32)
    wq[0] = new_q0.T
    want = {**params, "layers": {**params["layers"], "wq": wq}}
    got = engine.call(Call(lambda core: jax.tree.map(np.asarray, core.runner.params))).result()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.array_equal(a.view(np.uint32), np.asarray(b, np.float32).view(np.uint32))

    v1_dir = save_hf_dir(tmp_path / "v1", cfg, perturbed(params, 1))
    staged = engine.stage_weights_from_disk(str(v1_dir), "v1")
    assert staged.ok and staged.details["tensors"] > 0, staged
    st = engine.get_internal_state()
    assert st["weight_version"] == "partial" and st["engine_paused"]  # held until publish
    col = Collector(engine)
    col.submit("late", _prompts()[0], GREEDY)
    assert engine.get_internal_state()["waiting_rids"] == ["late"] and not col.snapshots
    res = engine.publish_staged_weights(staged.details["token"])
    assert res.ok and res.details["weight_version"] == "v1", res
    out = col.wait()[("late", 0)]
    assert out.weight_segments == (WeightSegment(0, "v1"),)

    staged = engine.stage_weights_from_disk(str(v1_dir), "v2")
    assert engine.discard_staged_weights(staged.details["token"]).details["discarded"]
    st = engine.get_internal_state()
    assert st["weight_version"] == "v1" and not st["engine_paused"]
    res = engine.publish_staged_weights(staged.details["token"])
    assert not res.ok and "no staged weights" in res.message


async def test_http_update_and_read_routes(engine: Any, original: tuple, tmp_path: Path,
                                           tiny_model_dir: Path) -> None:
    from multiserve.model.loading.loader import save_hf_dir
    from multiserve.server.app import build_app
    from multiserve.server.control_routes import add_rl_routes
    from multiserve.server.tokenizer import TokenizerManager

    cfg, params = original
    p1 = perturbed(params, 1)
    v1_dir = save_hf_dir(tmp_path / "v1", cfg, p1)
    app = build_app(engine, TokenizerManager(tiny_model_dir, context_len=1024,
                                             model_name="tiny"))
    add_rl_routes(app, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://engine") as http:
        r = await http.post("/update_weights_from_disk",
                            json={"model_path": str(v1_dir), "weight_version": "v1"})
        assert r.status_code == 200 and r.json()["weight_version"] == "v1", r.text
        r = await http.get("/get_weights_by_name",
                           params={"name": "model.norm.weight", "truncate_size": 4})
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(np.asarray(r.json()["values"], np.float32),
                                      p1["final_norm"][:4])
        r = await http.post("/get_weights_by_name", json={"name": "model.nope"})
        assert r.status_code == 400 and "model.nope" in r.text
        r = await http.post("/update_weights_from_disk",
                            json={"path": str(tmp_path / "missing"), "weight_version": "v2"})
        assert r.status_code == 400 and "missing" in r.json()["message"]
        # no weight_version (optional, as in sglang): a new version string is made
        r = await http.post("/update_weights_from_disk", json={"path": str(v1_dir)})
        assert r.status_code == 200 and r.json()["weight_version"].startswith("v1-"), r.text
        r = await http.post("/stage_weights_from_disk",
                            json={"path": str(tiny_model_dir), "weight_version": "default"})
        assert r.status_code == 200, r.text
        r = await http.post("/publish_staged_weights", json={"token": r.json()["token"]})
        assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
        assert (await http.get("/get_model_info")).json()["weight_version"] == "default"


class _FailsToStage:
    """An engine client whose staging fails (as a full disk or device would). The engine's
    other public methods are copied onto the instance: isinstance against a
    runtime-checkable protocol (RLClient) looks attributes up statically from Python 3.12
    on, so a __getattr__ forward would not make it one."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        for name in dir(engine):
            if not name.startswith("_") and not hasattr(type(self), name):
                setattr(self, name, getattr(engine, name))

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        if name == "stage_weights_from_disk":
            return ControlResult(False, "injected failure: no space left on device")
        return await self._engine.acontrol(name, **args)


async def test_supervisor_fleet_update_is_all_or_nothing(
        engine: Any, tiny_engine_no_overlap: Any, original: tuple, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
    from multiserve.model.loading.loader import save_hf_dir

    cfg, params = original
    engines: list[Any] = [engine, tiny_engine_no_overlap]
    app = build_supervisor_app(engines)
    add_rl_supervisor_routes(app)
    v1_dir = save_hf_dir(tmp_path / "v1", cfg, perturbed(params, 1))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://sup") as http:
            r = await http.post("/update_weights_from_disk",
                                json={"path": str(v1_dir), "weight_version": "v1"})
            assert r.status_code == 200 and r.json()["phase"] == "publish", r.text
            info = (await http.get("/get_server_info")).json()
            assert [s["weight_version"] for s in info["internal_states"]] == ["v1", "v1"]

            engines[1] = _FailsToStage(tiny_engine_no_overlap)
            r = await http.post("/update_weights_from_disk",
                                json={"path": str(tiny_model_dir), "weight_version": "v2"})
            body = r.json()
            assert r.status_code == 400 and body["phase"] == "stage", r.text
            assert body["failed_engines"] == [1]
            assert "engine 1: injected failure: no space left" in body["message"]
            info = (await http.get("/get_server_info")).json()
            for s in info["internal_states"]:
                assert s["weight_version"] == "v1" and not s["engine_paused"]
            assert not engine.discard_staged_weights().details["discarded"]  # was discarded

            r = await http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
            assert r.status_code == 200, r.text
            assert all(s["memory_released"] == ["kv_cache"] for s in
                       (await http.get("/get_server_info")).json()["internal_states"])
            r = await http.post("/resume_memory_occupation", json={})
            assert r.status_code == 200, r.text
    finally:
        _restore(tiny_engine_no_overlap, tiny_model_dir)


def test_finite_each_reads_every_shard_in_place() -> None:
    """The placed arrays' NaN / inf check on CPU devices (read on the host): every dtype's
    inf and NaN found wherever they sit, in any shard of a sharded array."""
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from multiserve.engine.rl.checks import finite_each

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    split = NamedSharding(mesh, PartitionSpec("x"))
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for bad in (np.inf, -np.inf, np.nan):
            x = np.ones((4, 3), dtype)
            x[3, 2] = bad  # in the second device's shard
            y = np.ones((4, 3), dtype)
            got = finite_each([jax.device_put(x, split), jax.device_put(y, split),
                               jax.device_put(x), jax.device_put(y)])
            assert got == [False, True, False, True], (dtype, bad, got)
    assert finite_each([]) == []


# ---- the weight-update session (tpu-inference's / vLLM's names, issue 63 item 4) -------------

def test_weight_session_as_tpu_inference_runs_it(engine: Any, original: tuple, before: dict,
                                                 tiny_model_dir: Path) -> None:
    """tpu-inference's VllmSampler: pause, start_weight_update(free_kv_cache=True),
    update_weights, finish_weight_update, resume. The new weights serve under the version
    finish names; a second session back to the checkpoint restores the outputs exactly."""
    _, params = original
    assert engine.pause_generation("abort", clear_cache=True).ok
    started = engine.start_weight_update()  # free_kv_cache=True: tpu-inference's default
    assert started.ok and started.details["free_kv_cache"], started
    st = engine.get_internal_state()
    assert st["memory_released"] == ["kv_cache"]
    assert st["pause_reasons"] == ["memory_released", "user", "weights_staged"]
    staged = engine.update_weights({"params": perturbed(params, 5)})
    assert staged.ok and staged.details["tensors"] > 0, staged
    done = engine.finish_weight_update("v-session")
    assert done.ok and done.details["weight_version"] == "v-session", done
    assert done.details["kv_cache_resumed"]
    st = engine.get_internal_state()
    assert st["memory_released"] == [] and st["pause_reasons"] == ["user"]
    assert engine.continue_generation().ok
    after = _run(engine)
    assert {o.weight_version for o in after.values()} == {"v-session"}
    assert _ids(after) != _ids(before)
    # vLLM's disk backend: a checkpoint directory; the KV pool kept (free_kv_cache=False)
    assert engine.pause_generation("retract").ok
    assert engine.start_weight_update(free_kv_cache=False).ok
    assert engine.update_weights({"path": str(tiny_model_dir)}).ok
    back = engine.finish_weight_update("default")
    assert back.ok and "kv_cache_resumed" not in back.details
    assert engine.continue_generation().ok
    again = _run(engine)
    for k, out in before.items():
        assert again[k].output_ids == out.output_ids and again[k].logprobs == out.logprobs


def test_weight_session_refusals_change_nothing(engine: Any, tmp_path: Path) -> None:
    no = engine.update_weights({"path": str(tmp_path)})
    assert not no.ok and no.details["refused"] == "no_session"
    assert engine.finish_weight_update().details["refused"] == "no_session"
    assert engine.abort_weight_update().ok  # nothing open: a no-op
    assert engine.pause_generation("abort").ok
    assert engine.start_weight_update().ok
    assert engine.start_weight_update().details["refused"] == "session_open"
    bad = engine.update_weights({"path": str(tmp_path)})  # an empty directory
    assert not bad.ok and bad.details["error"]
    st = engine.get_internal_state()  # the failed staging aborted the session: KV back
    assert st["memory_released"] == [] and st["pause_reasons"] == ["user"]
    assert engine.start_weight_update(free_kv_cache=False).ok
    empty = engine.finish_weight_update("never")
    assert not empty.ok and empty.details["refused"] == "nothing_staged"
    assert engine.get_internal_state()["pause_reasons"] == ["user"]
    assert engine.get_internal_state()["weight_version"] == "default"
    for info, what in (({"names": ["w"], "dtype_names": ["bf16"], "shapes": [[1]]}, "NCCL"),
                       ({"names": ["w"], "sizes": [1], "ipc_handles": {}}, "CUDA IPC"),
                       ({"path": "relative/dir"}, "absolute"), ({}, "exactly one"),
                       ("x", "object")):
        with pytest.raises(ValueError, match=what):
            engine.update_weights(info)
