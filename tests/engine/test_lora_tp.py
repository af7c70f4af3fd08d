"""LoRA on a tensor-parallel engine (two devices): the adapter buffers are replicated on
every device of the engine (not sharded: a rank-r A and B are small, and each device's
shard of a projection adds the columns of the replicated delta it holds), the delta
takes the XLA form (the native kernel never runs on operands split over a group), and a
mixed batch gives the one-device LoRA engine's greedy ids, logprobs within 1e-4 (the
base products run XLA's formulations over per-device shapes, not the native kernels)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import pytest
from engine_helpers import TINY_ENGINE
from lora_checkpoints import loaded, peft_tensors

from multiserve.types import SamplingParams

PROMPTS = [[5, 9, 13, 17, 21], [7, 3, 30, 44, 12, 6, 9, 19, 40, 8, 11], [14, 15, 16]]
ROWS = [(0, None), (0, "a1"), (1, "a2"), (2, "a1"), (1, None), (2, "a2")]
# the six rows' steps only: one token bucket and one row bucket (fewer, cheaper compiles)
SMALL = dict(precompile_token_paddings=(64,), precompile_bs_paddings=(8,),
             max_running_requests=8)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                        return_logprob=True)


def _engine(model: Path, **kw: Any) -> Iterator[Any]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(model), **{**TINY_ENGINE, **SMALL, **kw},
                              max_loras_per_batch=2, max_lora_rank=8))
    cfg = eng.model_config
    loaded(eng.load_lora_adapter("a1", tensors=peft_tensors(cfg, 4, 1), r=4, lora_alpha=8))
    loaded(eng.load_lora_adapter("a2", tensors=peft_tensors(cfg, 8, 2), r=8, lora_alpha=16))
    try:
        yield eng
    finally:
        eng.shutdown()


def _run(engine: Any) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=[PROMPTS[p] for p, _ in ROWS], sampling_params=GREEDY,
                           lora_name=[name for _, name in ROWS])
    return [(list(o.output_ids), [t.logprob for t in o.logprobs]) for o in outs]


def test_tensor_parallel_lora_matches_one_device(tiny_model_dir: Path) -> None:
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS from tests/conftest.py)")
    want = next(_run(e) for e in _engine(tiny_model_dir))
    for eng in _engine(tiny_model_dir, device_indexes=(0, 1)):
        runner = eng._core.runner  # noqa: SLF001 - where the adapter buffers live
        buf = runner.lora["wq_a"]
        assert {d.id for d in buf.sharding.device_set} == {0, 1}
        assert buf.sharding.is_fully_replicated
        assert eng.get_internal_state()["lora_kernel"] == "xla"
        got = _run(eng)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    diff = max(abs(a - b) for (_, g), (_, w) in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True))
    assert diff <= 1e-4, diff
