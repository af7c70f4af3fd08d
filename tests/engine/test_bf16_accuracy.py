"""bfloat16 accuracy, stated and tested: the engine serving a bfloat16 checkpoint against
transformers running the same checkpoint in bfloat16 (greedy ids: where they first differ,
the two tokens are near-tied in the float32 reference's logits, so only rounding could
flip them), and its logits against the same model in float32.

Tolerances (this tiny model, 2 layers, random weights scaled so logits are O(1)):
- a divergence is allowed only where the float32 reference's logits of the two tokens are
  within NEAR_TIE of each other;
- bf16 engine vs the float32 reference: every logprob (chosen and top-5) within
  LOGPROB_TOL."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from multiserve.types import SamplingParams

NEAR_TIE = 0.25  # float32 logits of two tokens this close may be swapped by bf16 rounding
LOGPROB_TOL = 0.05
STEPS = 16
torch.set_num_threads(1)


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir_bf16: Path) -> dict[str, Any]:
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir_bf16, torch_dtype=dtype).eval()
        for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32))}


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def _f32_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_bf16_greedy_ids_follow_transformers_bf16_up_to_near_ties(
        tiny_engine_bf16: Any, hf_models: dict[str, Any]) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    report = []
    for prompt in _prompts():
        ours = list(tiny_engine_bf16.generate(input_ids=prompt,
                                              sampling_params=greedy).output_ids)
        theirs = _hf_greedy(hf_models["bf16"], prompt)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), STEPS)
        report.append(first)
        if first < STEPS:
            ref = _f32_logits(hf_models["f32"], prompt + ours[:first])[-1]
            gap = abs(float(ref[ours[first]] - ref[theirs[first]]))
            assert gap <= NEAR_TIE, (prompt, first, gap)
    print(f"first divergence per prompt (of {STEPS}): {report}")


def test_bf16_logprobs_are_close_to_f32(tiny_engine_bf16: Any,
                                        hf_models: dict[str, Any]) -> None:
    """Every generated token's logprob and its top-5 alternatives' from the bfloat16 engine
    against log_softmax of the float32 reference (the same bf16 checkpoint, computed in
    float32 by transformers) at the same positions."""
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True,
                            return_logprob=True, top_logprobs_num=5)
    worst = 0.0
    for prompt in _prompts(4):
        out = tiny_engine_bf16.generate(input_ids=prompt, sampling_params=params)
        ids = list(out.output_ids)
        ref = torch.log_softmax(torch.from_numpy(_f32_logits(hf_models["f32"], prompt + ids)),
                                -1).numpy()
        for i, (tok, lp) in enumerate(zip(ids, out.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + i]
            worst = max(worst, abs(lp.logprob - float(row[tok])),
                        *(abs(v - float(row[t])) for t, v in lp.top))
    print(f"bf16 vs fp32 logprobs: max |diff| = {worst:.4f}")
    assert worst <= LOGPROB_TOL
