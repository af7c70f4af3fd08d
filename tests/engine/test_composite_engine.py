"""An engine serving Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration, from
tests/family_checkpoints.py `make_gemma3_multimodal`) as its text model, as an RL loop
post-training Gemma 3 4B runs it: the plan verified, a batch equal to each request alone
(ids and logprobs bit for bit, greedy and seeded), greedy ids equal transformers'
multimodal model's `generate`, then a new checkpoint of the same architecture published
from disk (`update_weights_from_disk`, the trainer's saved names) serves its own
transformers' ids, and a tensor read back by the checkpoint's name is the new one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import (
    TINY_ENGINE,
    Collector,
    greedy_and_seeded,
    ids_and_logprobs,
    run_alternating,
)
from family_checkpoints import WINDOW, make_gemma3_multimodal
from moe_checkpoints import save

from multiserve.config import EngineConfig

MAX_NEW = 16
PAIR = greedy_and_seeded(MAX_NEW)
HEAD_Q = "language_model.model.layers.0.self_attn.q_proj.weight"  # as the checkpoint saves it


def _prompts(n: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(3, 500, int(rng.integers(WINDOW + 5, 50)))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Any]]:
    """(engine, its checkpoint dir, the checkpoint's transformers model)."""
    from multiserve.engine.engine import Engine

    model = make_gemma3_multimodal(seed=21)
    path = save(model, tmp_path_factory.mktemp("gemma3-mm"))
    eng = Engine(EngineConfig(model_path=str(path), dtype="float32",
                              **{**TINY_ENGINE, "precompile_token_paddings": (64,)}))
    try:
        yield eng, path, model
    finally:
        eng.shutdown()


def _generate(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(engine: Any, prompt: list[int], n: int) -> list[int]:
    col = Collector(engine)
    col.submit("g", prompt, PAIR[0].with_updates(max_new_tokens=n))
    return list(col.wait()[("g", 0)].output_ids)


def test_batch_equals_alone_and_greedy_equals_transformers(served) -> None:
    engine, _, model = served
    state = engine.get_internal_state()
    assert state["determinism"]["verified"], state["determinism"]["problems"]
    prompts = _prompts()
    batch = run_alternating(engine, prompts, PAIR)
    for i, p in enumerate(prompts):
        col = Collector(engine)
        col.submit(f"r{i}", p, PAIR[i % 2])
        assert ids_and_logprobs(col.wait())[(f"r{i}", 0)] == batch[(f"r{i}", 0)], i
    prompt = prompts[0]
    assert _greedy(engine, prompt, 24) == _generate(model, prompt, 24)


def test_a_new_checkpoint_from_disk_serves_its_own_ids(served, tmp_path) -> None:
    engine, _, _ = served
    trained = make_gemma3_multimodal(seed=22)
    path = save(trained, tmp_path / "step-1")
    result = engine.update_weights_from_disk(str(path), weight_version="step-1")
    assert result.ok, result.message
    prompt = _prompts(1)[0]
    assert _greedy(engine, prompt, 24) == _generate(trained, prompt, 24)
    got = engine.get_weights_by_name(HEAD_Q, truncate_size=2)
    assert got.ok, got.message
    want = trained.state_dict()["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(np.asarray(got.details["values"], np.float32), want[:2].numpy())
    assert got.details["weight_version"] == "step-1"
