"""The families added after Llama / Qwen (tests/family_checkpoints.py), from checkpoints
transformers itself wrote: the config and every tensor read through our loader (single file
and sharded), logits of ragged paged batches (prompts longer than the window, chunked,
decoding beside other sequences) against transformers' in float32 (LOGITS_TOL: the
families' differences are rounding-order only), greedy ids equal to `generate` for prompts
longer than the window, and the logits bitwise batch invariant
(test_batch_invariance.run_modes)."""

from __future__ import annotations

from typing import Any

import checkpoint_checks as checkpoints
import jax
import numpy as np
import pytest
import torch
from checkpoint_checks import Checkpoint
from family_checkpoints import ARCHS, WINDOW, make_model
from model_helpers import PagedSim

from multiserve.model.loading.loader import load_model

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
LOGITS_TOL = 1e-3  # max |ours - transformers'| over every logit, float32 (|logits| > 1)
CHECKPOINTS = checkpoints.Checkpoints(make_model)


def checkpoint(arch: str, factory: pytest.TempPathFactory) -> Checkpoint:
    """(transformers model, its single-file dir, its sharded dir), built once per arch."""
    return CHECKPOINTS.get(arch, factory)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_loads_single_and_sharded(arch: str, tmp_path_factory) -> None:
    ckpt = checkpoint(arch, tmp_path_factory)
    cfg = checkpoints.loaded_config(ckpt, arch)
    types = getattr(ckpt[0].config, "layer_types", None) or ["sliding_attention"] * \
        cfg.num_layers
    assert cfg.sliding_window == WINDOW
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(types)
                                       if t == "sliding_attention")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ragged_paged_batches_match_transformers(arch: str, tmp_path_factory) -> None:
    diff, scale = checkpoints.ragged_logits_diff(checkpoint(arch, tmp_path_factory))
    print(f"{arch}: max|logits diff| = {diff:.2e} (max|logit| = {scale:.2f})")
    assert scale > 1.0
    assert diff <= LOGITS_TOL


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_ids_match_transformers_generate(arch: str, tmp_path_factory) -> None:
    got, want = checkpoints.greedy_ids_and_generates(checkpoint(arch, tmp_path_factory),
                                                     3 * WINDOW)
    assert got == want
    assert len(set(got)) > 3  # a varied continuation, not one repeated token


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_are_bitwise_batch_invariant(arch: str, tmp_path_factory) -> None:
    """test_batch_invariance's batchings (full prefill, mixed T=256 batch, chunked prefill,
    decode beside others at T = 64/128, lone T = 1 decode, small T = 2..8 steps), the
    windows of the probed positions starting in other key blocks than their chunk-mates'."""
    from test_batch_invariance import assert_bitwise_equal, run_modes

    _, path, _ = checkpoint(arch, tmp_path_factory)
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    rng = np.random.default_rng(5)
    target = [int(t) for t in rng.integers(3, cfg.vocab_size, 70)]
    probe = sorted({0, 1, 11, 12, 13, 15, 16, 17, 40, 63, 64, 65, 69} | set(range(50, 55)))
    out = run_modes(jax.device_put(loaded.params), cfg, target, probe, page_size=4, block=16)
    assert_bitwise_equal(out, probe)
    assert not np.array_equal(out["prefill_T128"][0], out["prefill_T128"][69])


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "mistral", "mixtral"])
def test_two_device_forward_matches_one_device(arch: str, tmp_path_factory) -> None:
    """The checkpoint's params split over 2 devices (heads, MLP or experts, vocabulary:
    the family's rules) give one device's logits within 1e-4 (tests/model/test_sharding.py:
    no product splits its contraction), windows and sinks on sharded heads included; each
    forward on a plan calibrated for its own shapes at the one step size it runs. (Gemma
    2 adds to Gemma 3's decoder only elementwise soft caps: left out for the suite's
    time.)"""
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.workload import workload_for
    from multiserve.model.sharding import kv_pool_sharding, make_mesh, shard_params
    from multiserve.model.tensor_parallel import TensorParallel

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS from tests/conftest.py)")
    _, path, _ = checkpoint(arch, tmp_path_factory)
    loaded = load_model(str(path), "float32")
    cfg = loaded.config

    def run(params: Any, devices: int, **kw: Any) -> dict:
        plan = calibrate(workload_for(cfg, (64,), (64,), 64, 4, 16, np.float32, tp=devices,
                                      engine_defaults=False), jax.devices()[0]).plan
        assert plan.verified
        sim = PagedSim(params, cfg, page_size=4, block_size=16, num_pages=128, plan=plan,
                       **kw)
        rng = np.random.default_rng(0)
        for k in "abc":
            sim.add(k, [int(t) for t in rng.integers(3, cfg.vocab_size, 45)])
        got: dict = {}
        for i, work in enumerate([[("a", 40), ("b", 9)], [("a", 1), ("b", 1), ("c", 20)],
                                  [("c", 1), ("a", 1)], [("a", 1), ("b", 1), ("c", 1)]]):
            got.update(sim.step(work, T=64, R=64, rows=np.random.default_rng(i)))
        return got

    ref = run(jax.device_put(loaded.params, jax.devices()[0]), 1)
    mesh = make_mesh(jax.devices()[:2])
    got = run(shard_params(loaded.params, cfg, mesh), 2,
              kv_sharding=kv_pool_sharding(cfg, mesh), tp=TensorParallel.of(mesh, cfg))
    diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    print(f"{arch} on 2 devices: max|logits diff| = {diff:.2e}")
    assert diff <= 1e-4


def test_every_family_config_round_trips_through_config_json(tmp_path) -> None:
    """config.json as we write it (`config_to_hf`: what the GGUF cache and the bench's
    random models write) reads back as the same ModelConfig, for the bench's random
    config of every family (bench/random_model.py)."""
    import json

    from multiserve.bench.random_model import SIZES
    from multiserve.model.loading.hf import config_from_hf, config_to_hf

    for name, cfg in SIZES.items():
        raw = json.loads(json.dumps(config_to_hf(cfg)))
        assert config_from_hf(raw, tmp_path / name) == cfg, name
