"""Prompt logprobs (`GenerateRequest.return_prompt_logprobs`): entry j scores prompt token j
given tokens < j (entry 0 is None). They must equal the model's own log-softmax at every
position, whether the prompt is prefilled in chunks, cached, or shares steps with others."""

from __future__ import annotations

import queue

import numpy as np
from engine_helpers import TINY_VOCAB, WAIT_S, ReferenceModel

from multiserve.engine.streams import assembling
from multiserve.types import GenerateRequest, RequestOutput, SamplingParams


def _run(engine, rid: str, prompt: list[int], top: int = 3) -> RequestOutput:
    q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    engine.submit(GenerateRequest(rid=rid, input_ids=tuple(prompt), return_prompt_logprobs=True,
                                  sampling=SamplingParams(temperature=0.0, max_new_tokens=2,
                                                          top_logprobs_num=top)),
                  assembling(q.put))
    while True:
        out = q.get(timeout=WAIT_S)
        if out.finished:
            return out


def _reference(model_path: str, prompt: list[int]) -> list[np.ndarray]:
    """Teacher-forced: row i is the log-softmax after prompt[: i + 1]."""
    ref = ReferenceModel(model_path)
    _, rows = ref.run(prompt[:1], len(prompt) - 1, lambda _row, out: prompt[len(out) + 1])
    return rows


def test_prompt_logprobs_match_the_model_across_chunks_cache_and_batching(
        tiny_engine, tiny_model_dir):
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, TINY_VOCAB, 150)]  # 5 chunks of 32
    rows = _reference(str(tiny_model_dir), prompt)
    want = [float(rows[j - 1][prompt[j]]) for j in range(1, len(prompt))]

    first = _run(tiny_engine, "plp-a", prompt)
    # again: the prompt's pages are now cached, yet every position is still scored
    second = _run(tiny_engine, "plp-b", prompt)
    assert second.cached_tokens == 0
    # and next to other requests that are decoding (rows are shared in each step)
    others = queue.SimpleQueue()
    for i in range(6):
        tiny_engine.submit(GenerateRequest(
            rid=f"plp-o{i}", input_ids=tuple(prompt[i:i + 20]),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=12)), others.put)
    third = _run(tiny_engine, "plp-c", prompt)
    done = 0
    while done < 6:
        done += others.get(timeout=WAIT_S).finished

    for out in (first, second, third):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        got = [lp.logprob for lp in plp[1:]]
        assert [lp.token_id for lp in plp[1:]] == prompt[1:]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        for j, lp in enumerate(plp[1:], start=1):
            assert len(lp.top) == 3
            best = int(np.argmax(rows[j - 1]))
            assert lp.top[0][0] == best and lp.top[0][1] >= lp.logprob - 1e-6
    # bit-identical however the prompt was scheduled (batch-invariant numerics)
    assert first.prompt_logprobs == second.prompt_logprobs == third.prompt_logprobs
    assert first.output_ids == second.output_ids == third.output_ids


def test_prompt_logprobs_off_by_default(tiny_engine):
    out = tiny_engine.generate(input_ids=[5, 6, 7, 8],
                               sampling_params=SamplingParams(temperature=0, max_new_tokens=2))
    assert out.prompt_logprobs is None
