"""Resumable requests (issue 7): an aborted request returns its partial output ids and
logprobs; re-submitting prompt + partial with the remaining budget continues it, and the
concatenation equals the uninterrupted output, greedy and seeded (draws are keyed by
(seed, sample index, position), and a resumed token keeps its position); in float32 and in
bfloat16."""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger

from multiserve.types import SamplingParams

MAX_NEW = 20
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                             return_logprob=True),
    "seeded": SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4242,
                             max_new_tokens=MAX_NEW, ignore_eos=True, return_logprob=True),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 40))]
            for _ in range(4)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_abort_then_resubmit_equals_uninterrupted(tiny_engine_each_dtype: Any,
                                                  trigger: Trigger, case: str) -> None:
    tiny_engine = tiny_engine_each_dtype  # float32, then bfloat16
    params = CASES[case]
    prompts = _prompts()
    full = Collector(tiny_engine)
    full.submit_all(prompts, params)
    want = full.wait()

    hook = AtTokens(trigger, "r0", 7, lambda: tiny_engine.acontrol("abort_request",
                                                                   abort_all=True))
    col = Collector(tiny_engine, on_output=hook)
    col.submit_all(prompts, params)
    hook.wait()
    partial = col.wait()
    resumed = Collector(tiny_engine)
    for i, prompt in enumerate(prompts):
        part = partial[(f"r{i}", 0)]
        assert len(part.logprobs) == len(part.output_ids)
        assert part.finish_reason == "abort" or len(part.output_ids) == MAX_NEW, {
            k: (o.finish_reason, len(o.output_ids)) for k, o in partial.items()}
        budget = MAX_NEW - len(part.output_ids)
        if budget:
            resumed.submit(f"r{i}", prompt + list(part.output_ids),
                           params.with_updates(max_new_tokens=budget))
    rest = resumed.wait()
    for i in range(len(prompts)):
        key = (f"r{i}", 0)
        part, ref = partial[key], want[key]
        tail = rest[key] if key in rest else None
        ids = part.output_ids + (tail.output_ids if tail else ())
        assert ids == ref.output_ids, (case, key)
        lps = [lp.logprob for lp in part.logprobs + (tail.logprobs if tail else ())]
        assert lps == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    assert len(partial[("r0", 0)].output_ids) == 7  # the abort landed where it was asked
    assert len(rest) >= 2  # several requests were really resumed
