"""Checks shared by the tests of families whose tiny checkpoints transformers writes
(tests/moe_checkpoints.py, tests/family_checkpoints.py): the checkpoint dirs built once per
architecture, the load of both file layouts with every tensor round-tripping by name, and
ragged paged batches' logits against transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from model_helpers import PagedSim
from moe_checkpoints import save

from multiserve.config import ModelConfig
from multiserve.model.loading.hf_names import params_to_hf
from multiserve.model.loading.loader import load_model
from multiserve.model.loading.safetensors_io import load_file
from multiserve.model.simple_generate import greedy_token_ids

Checkpoint = tuple[Any, Path, Path]  # (transformers model, single-file dir, sharded dir)


class Checkpoints:
    """A test module's checkpoints: make(arch, seed=) saved as one file and sharded, built
    once per architecture (`get`)."""

    def __init__(self, make: Callable[..., Any]) -> None:
        self.make = make
        self.built: dict[str, Checkpoint] = {}

    def get(self, arch: str, factory: pytest.TempPathFactory) -> Checkpoint:
        if arch not in self.built:
            model = self.make(arch, seed=len(arch))
            single = save(model, factory.mktemp(f"{arch}-single"))
            sharded = save(model, factory.mktemp(f"{arch}-sharded"), sharded=True)
            self.built[arch] = (model, single, sharded)
        return self.built[arch]


def loaded_config(ckpt: Checkpoint, arch: str) -> ModelConfig:
    """Both layouts of the checkpoint load to one config of `arch`, and every tensor
    round-trips by name, bit for bit; returns the config."""
    _, single, sharded = ckpt
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(str(single)), load_model(str(sharded))
    cfg = a.config
    assert b.config == cfg and cfg.architecture == arch
    on_disk = load_file(single / "model.safetensors")
    for params in (a.params, b.params):
        ours = params_to_hf(params, cfg)
        assert set(ours) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set()) \
            >= set(on_disk)
        for name, arr in ours.items():
            assert np.array_equal(arr, on_disk[name]), name
    return cfg


def ragged_logits_diff(ckpt: Checkpoint) -> tuple[float, float]:
    """(max |ours - transformers'| over every logit, max |logit|) of three prompts run
    as ragged paged batches: chunked prefills, decoding beside other sequences, rows
    shuffled, 4-token pages."""
    model, path, _ = ckpt
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    rng = np.random.default_rng(1)
    lens = {"a": 37, "b": 9, "c": 26}
    toks = {k: [int(t) for t in rng.integers(3, cfg.vocab_size, n)] for k, n in lens.items()}
    with torch.no_grad():
        ref = {k: model(torch.tensor([v])).logits[0].numpy() for k, v in toks.items()}
    sim = PagedSim(jax.device_put(loaded.params), cfg, page_size=4, block_size=8)
    for k, v in toks.items():
        sim.add(k, v)
    everything = {k: list(range(n)) for k, n in lens.items()}
    got: dict = {}
    schedule = [[("a", 30), ("b", 6)], [("a", 1), ("b", 1), ("c", 11)],
                [("a", 1), ("c", 13), ("b", 1)], [("c", 1), ("b", 1), ("a", 1)],
                [("a", 1), ("c", 1)], [("a", 1)], [("a", 1)], [("a", 1)]]
    for i, work in enumerate(schedule):
        got.update(sim.step(work, T=64, B=64, R=64, rows=np.random.default_rng(i),
                            logits_for=everything))
    assert set(got) == {(k, p) for k, n in lens.items() for p in range(n)}
    diff = max(float(np.max(np.abs(got[(k, p)] - ref[k][p]))) for k, p in got)
    return diff, max(float(np.max(np.abs(r))) for r in ref.values())


def greedy_ids_and_generates(ckpt: Checkpoint, prompt_len: int, new_tokens: int = 24
                             ) -> tuple[list[int], list[int]]:
    """(our greedy ids, transformers' `generate` ids) for a seeded random prompt of
    `prompt_len` tokens, float32, no EOS."""
    model, path, _ = ckpt
    loaded = load_model(str(path), "float32")
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 500, prompt_len)]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    got = greedy_token_ids(jax.device_put(loaded.params), loaded.config, prompt, new_tokens)
    return got, want
