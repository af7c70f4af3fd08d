"""A Qwen3-MoE engine (tests/moe_checkpoints.py: 3 layers, sparse-dense-sparse, 8 experts,
top-2) on the shared tiny engines' settings: batch = alone and the pause-proof identity
bit for bit (ids and logprobs), weight updates of every MoE tensor (router and experts)
from a perturbed checkpoint on disk and back (bitwise restored), one expert by HF name,
staged publish, release/resume; and a 2-device engine (experts split by intermediate dim
or by expert) against one device."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from engine_helpers import (
    TINY_ENGINE,
    AtTokens,
    Collector,
    Oracle,
    Trigger,
    assert_idle_and_clean,
    drafting,
    greedy_and_seeded,
    ids_and_logprobs,
    run_alternating,
)
from moe_checkpoints import make_model, save

from multiserve.config import EngineConfig
from multiserve.types import SamplingParams
from tests.multihost.scenarios import collectives

MAX_NEW = 12
PAIR = greedy_and_seeded(MAX_NEW)
EXPERT = "model.layers.2.mlp.experts.5.down_proj.weight"
ROUTER = "model.layers.0.mlp.gate.weight"


def _prompts(seed: int = 3, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    return [PAIR[i % 2] for i in range(n)]


def _run(engine: Any, prompts: list[list[int]] | None = None, hook: Any = None) -> dict:
    return run_alternating(engine, prompts or _prompts(), PAIR, hook)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(make_model("qwen3_moe", seed=9), tmp_path_factory.mktemp("qwen3-moe"))


def _engine(path: Path, **kw: Any) -> Iterator[Any]:
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(path), **{**TINY_ENGINE, **kw}))
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path) -> Iterator[Any]:
    yield from _engine(moe_dir)


@pytest.fixture(scope="module")
def reference(moe_engine: Any) -> dict:
    """Every prompt's outputs, all submitted together (the original weights)."""
    return _run(moe_engine)


def test_moe_engine_batch_equals_alone_and_survives_pauses(moe_engine: Any, reference: dict,
                                                           trigger: Trigger) -> None:
    prompts = _prompts()
    assert len({ids for ids, _ in reference.values()}) == len(prompts)  # varied outputs
    for i, p in enumerate(prompts):  # alone: routed groups of one request only
        col = Collector(moe_engine)
        col.submit(f"r{i}", p, _params(len(prompts))[i])
        assert ids_and_logprobs(col.wait())[(f"r{i}", 0)] == reference[(f"r{i}", 0)], i
    for mode in ("retract", "in_place"):
        hook = AtTokens(trigger, "r0", 5, lambda m=mode: moe_engine.acontrol("pause_generation",
                                                                             mode=m))
        col = Collector(moe_engine, on_output=hook)
        col.submit_all(prompts, _params(len(prompts)))
        (res,) = hook.wait()
        assert res.ok, res
        assert moe_engine.continue_generation().ok
        assert ids_and_logprobs(col.wait()) == reference, mode
    assert moe_engine.get_internal_state()["determinism"]["verified"]
    assert_idle_and_clean(moe_engine)


@pytest.mark.parametrize("wrong", [False, True])
def test_moe_speculation_gives_the_outputs_without_it(moe_engine: Any, reference: dict,
                                                      wrong: bool) -> None:
    """Verify rows through the routed experts: drafts always right or always wrong, the
    same ids and logprobs as without speculation."""
    oracle = Oracle({k: ids for k, (ids, _) in reference.items()}, wrong=wrong, vocab=500)
    with drafting(moe_engine, oracle):
        assert _run(moe_engine) == reference
    state = moe_engine.get_internal_state()
    assert state["spec_verify_ct"] > 0 and oracle.proposed > 0
    assert_idle_and_clean(moe_engine)


def test_moe_weight_updates_change_outputs_and_restore_bitwise(
        moe_engine: Any, moe_dir: Path, reference: dict, tmp_path: Path) -> None:
    from multiserve.model.loading.hf import save_hf_dir
    from multiserve.model.loading.loader import load_model

    loaded = load_model(str(moe_dir))
    misses = moe_engine.get_internal_state()["cache_miss_count"]
    rng = np.random.default_rng(1)
    perturbed = jax.tree.map(
        lambda a: (a * (1 + 0.3 * rng.standard_normal(a.shape))).astype(np.float32),
        loaded.params)
    v1 = save_hf_dir(tmp_path / "v1", loaded.config, perturbed)  # our writer, MoE config
    res = moe_engine.update_weights_from_disk(str(v1), "v1")
    assert res.ok, res
    after = _run(moe_engine)
    assert sum(after[k][0] != reference[k][0] for k in reference) >= len(reference) - 1
    read = moe_engine.get_weights_by_name(ROUTER, truncate_size=2)
    np.testing.assert_array_equal(np.asarray(read.details["values"], np.float32),
                                  perturbed["moe"]["router"][0].T[:2])
    # back to the original checkpoint: bit for bit
    assert moe_engine.update_weights_from_disk(str(moe_dir), "default").ok
    assert _run(moe_engine) == reference
    # one expert matrix by HF name, staged then published: only it changes
    new = np.asarray(loaded.params["moe"]["we_down"][1, 5]).T * 2.0
    staged = moe_engine.stage_weights_from_tensor({EXPERT: new}, "one-expert")
    assert staged.ok, staged
    assert moe_engine.publish_staged_weights(staged.details["token"]).ok
    read = moe_engine.get_weights_by_name(EXPERT, truncate_size=64)
    assert read.details["shape"] == [64, 32]
    np.testing.assert_array_equal(np.asarray(read.details["values"], np.float32), new)
    other = moe_engine.get_weights_by_name(EXPERT.replace("experts.5", "experts.4"), 64)
    np.testing.assert_array_equal(np.asarray(other.details["values"], np.float32),
                                  np.asarray(loaded.params["moe"]["we_down"][1, 4]).T)
    assert moe_engine.update_weights_from_disk(str(moe_dir), "default").ok
    # release everything, resume: the same outputs
    assert moe_engine.release_memory_occupation().ok
    assert moe_engine.resume_memory_occupation().ok
    assert _run(moe_engine) == reference
    assert moe_engine.get_internal_state()["cache_miss_count"] == misses
    assert_idle_and_clean(moe_engine)


def two_device_plan(moe_dir: Path, moe_sharding: str) -> Any:
    """The 2-device engine's plan calibrated for exactly its own step sizes (TINY_ENGINE's
    buckets; `engine_defaults=False`), its products and grouped products probed as
    2-device shards: what the engine would calibrate itself, less a default engine's
    other sizes (ten token sizes, each a sharded probe compile per candidate row count),
    which these steps never run."""
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.workload import workload_for
    from multiserve.model.loading.loader import load_model

    cfg = load_model(str(moe_dir), "float32").config
    workload = workload_for(cfg, TINY_ENGINE["precompile_token_paddings"],
                            TINY_ENGINE["precompile_bs_paddings"],
                            max(TINY_ENGINE["precompile_bs_paddings"]),
                            TINY_ENGINE["page_size"], EngineConfig().attention_block_size,
                            np.float32, tp=2, moe_sharding=moe_sharding,
                            engine_defaults=False)
    assert all(u.sharded for u in (*workload.products, *workload.grouped))
    plan = calibrate(workload, jax.devices()[0]).plan
    assert plan.verified
    return plan


@pytest.mark.parametrize("moe_sharding", ["tensor", "expert"])
def test_moe_two_device_engine_matches_one_device(moe_dir: Path, reference: dict,
                                                  moe_sharding: str) -> None:
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS from tests/conftest.py)")
    plan = two_device_plan(moe_dir, moe_sharding)
    for eng in _engine(moe_dir, device_indexes=(0, 1), moe_sharding=moe_sharding,
                       invariance_plan=plan):
        runner = eng._core.runner  # noqa: SLF001 - where the experts live
        we = runner.params["moe"]["we_gate"]
        assert {d.id for d in we.sharding.device_set} == {0, 1}
        shard = we.addressable_shards[0].data.shape
        assert shard == ((2, 8, 64, 16) if moe_sharding == "tensor" else (2, 4, 64, 32))
        # the compiled step programs sum no partial results across devices: expert
        # parallelism's only float all-reduces are its gathers of the rows' expert
        # matrices (each device's experts, zeros elsewhere: exact in any order)
        seen = collectives(eng)
        assert seen["all-gather"] > 0, seen
        assert seen["float all-reduce sources"] == (
            [] if moe_sharding == "tensor" else ["gather"]), seen
        got = _run(eng)
        assert {k: ids for k, (ids, _) in got.items()} == \
            {k: ids for k, (ids, _) in reference.items()}
        diff = max(abs(a - b) for k in got for a, b in zip(got[k][1], reference[k][1]))
        print(f"{moe_sharding}: max |logprob diff| vs one device = {diff:.2e}")
        assert diff <= 1e-4
