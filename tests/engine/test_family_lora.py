"""LoRA on a family added after Llama / Qwen: a Gemma 3 engine (tests/family_checkpoints.py:
window and global layers, sandwich norms, tied embeddings, its decoder scanned at every
size) with a PEFT adapter that peft itself saved: greedy ids equal transformers + peft's,
logprobs within 1e-4 (float32 sums in other orders), and a batch mixing base rows and
adapter rows gives each row's bits alone, greedy and seeded (determinism.md §6a)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import TINY_ENGINE, greedy_and_seeded
from family_checkpoints import make_model
from lora_checkpoints import assert_matches_peft, loaded
from moe_checkpoints import save

from multiserve.config import EngineConfig
from multiserve.types import SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 8, 300, 12, 11, 4, 9, 70, 71, 72, 73], [3, 3, 8] * 6,
           list(range(100, 130))]


def _params(seeded: bool) -> SamplingParams:
    return greedy_and_seeded(12)[int(seeded)]


@pytest.fixture(scope="module")
def gemma_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """(the engine, with adapter "hf" loaded; transformers + peft's model of it)."""
    peft = pytest.importorskip("peft")
    import torch

    from multiserve.engine.engine import Engine

    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = make_model("gemma3", seed=21)
    path = save(base, tmp_path_factory.mktemp("gemma3-lora"))
    config = peft.LoraConfig(r=6, lora_alpha=12, init_lora_weights=False,
                             target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, config).eval()
    adapter = tmp_path_factory.mktemp("gemma3-adapter")
    model.save_pretrained(str(adapter))
    eng = Engine(EngineConfig(model_path=str(path), max_loras_per_batch=2, max_lora_rank=8,
                              **{**TINY_ENGINE, "precompile_token_paddings": (1, 8, 64)}))
    loaded(eng.load_lora_adapter("hf", str(adapter)))
    try:
        yield eng, model
    finally:
        eng.shutdown()


def _bits(out: Any) -> tuple[Any, ...]:
    return tuple(out.output_ids), tuple(t.logprob for t in out.logprobs)


def test_greedy_ids_and_logprobs_match_transformers_with_peft(gemma_lora: tuple) -> None:
    engine, model = gemma_lora
    assert_matches_peft(engine, model, PROMPTS, "hf", _params(False))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_mixed_rows_equal_each_alone(gemma_lora: tuple, seeded: bool) -> None:
    engine, _ = gemma_lora
    rows = [(0, None), (0, "hf"), (1, "hf"), (1, None), (2, "hf"), (2, None)]

    def run(batch: list[tuple[int, str | None]]) -> list[Any]:
        outs = engine.generate(input_ids=[PROMPTS[p] for p, _ in batch],
                               sampling_params=_params(seeded),
                               lora_name=[name for _, name in batch])
        return [_bits(o) for o in outs]

    assert run(rows) == [run([row])[0] for row in rows]
