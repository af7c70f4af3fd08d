"""Pause-proof determinism on the embedded default model with the shipped main job's engine
settings (configs/cpu-4.toml's [engine]: its buckets, chunked prefill, fused steps; only
the KV pool is smaller, as in test_fleet_validate.py): a request paused in any mode at
a given step and continued, or aborted and generated again, produces exactly the tokens
of an uninterrupted run, greedy and seeded, alone and among 16 concurrent requests.

Token ids alone rarely expose numerical drift (an argmax flips only on a near tie), so
the raw logprob of every sampled token must match bit for bit too: with shape buckets
below the batch-invariance threshold (e.g. T=16, B=16) the ids here still agree but the
logprobs differ by ~1e-5, and this test fails.

Also on that engine: greedy output equals the model's plain unbatched greedy loop for a
batch (n > 1, a prefix-cache hit on the chat template's system prompt). It lives here, not
in test_generate.py, so that one test process builds the default engine once.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import AtTokens, Collector, ReferenceModel, Trigger, held, ids_and_logprobs

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "Why is the sky blue?",
    "Write a haiku about autumn leaves falling.", "What is 12 times 7?",
    "Give me a short tip for learning a new language quickly.", "Who wrote Hamlet?",
    "Describe a cat in one sentence.", "What does a compiler do?",
    "List two benefits of regular exercise and explain each briefly.",
    "Translate 'good morning' into Spanish.", "What is the boiling point of water?",
    "Suggest a name for a small bakery.", "How many legs does a spider have?",
    "Explain what a prime number is to a ten year old child.", "What is photosynthesis?",
]


def _params(i: int, max_new: int) -> Any:
    from multiserve.types import SamplingParams

    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True,
                              return_logprob=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=31 + i, max_new_tokens=max_new,
                          ignore_eos=True, return_logprob=True)


@pytest.fixture(scope="module")
def prompts(_default_engine: Any) -> list[list[int]]:
    return [_default_engine.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


CASES = {  # name -> (request indexes, max_new_tokens); even index greedy, odd seeded
    "single-greedy": ([0], 16),
    "single-seeded": ([1], 16),
    "16-concurrent": (list(range(16)), 16),
}
_uninterrupted: dict[str, dict] = {}


def _submit(col: Collector, prompts: list[list[int]], case: str) -> None:
    idx, max_new = CASES[case]
    col.submit_all([prompts[i] for i in idx], [_params(i, max_new) for i in idx])


def _baseline(engine: Any, prompts: list[list[int]], case: str) -> dict:
    if case not in _uninterrupted:
        col = Collector(engine)
        _submit(col, prompts, case)
        _uninterrupted[case] = ids_and_logprobs(col.wait())
    return _uninterrupted[case]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_equals_uninterrupted(default_engine: Any, prompts: list,
                                                 trigger: Trigger, case: str,
                                                 mode: str) -> None:
    want = _baseline(default_engine, prompts, case)
    hook = AtTokens(trigger, "r0", 6,
                    lambda: default_engine.acontrol("pause_generation", mode=mode))
    col = Collector(default_engine, on_output=hook)
    _submit(col, prompts, case)
    (res,) = hook.wait()
    assert res.ok
    st = default_engine.get_internal_state()
    assert st["engine_paused"]
    if mode == "retract":
        assert res.details["retracted"] >= 1 and st["running_batch_size"] == 0
    else:
        assert st["running_batch_size"] >= 1
    assert default_engine.continue_generation().ok
    assert ids_and_logprobs(col.wait()) == want


@pytest.mark.parametrize("case", list(CASES))
def test_abort_then_regenerate_equals_uninterrupted(default_engine: Any, prompts: list,
                                                    trigger: Trigger, case: str) -> None:
    want = _baseline(default_engine, prompts, case)
    hook = AtTokens(trigger, "r0", 6, lambda: default_engine.acontrol("pause_generation",
                                                                  mode="abort"))
    col = Collector(default_engine, on_output=hook)
    _submit(col, prompts, case)
    hook.wait()
    partial = col.wait()
    assert all(o.finish_reason == "abort" for o in partial.values())
    for key, (ids, lps) in ids_and_logprobs(partial).items():
        assert (ids, lps) == (want[key][0][:len(ids)], want[key][1][:len(ids)])
    assert default_engine.continue_generation().ok
    again = Collector(default_engine)
    _submit(again, prompts, case)
    assert ids_and_logprobs(again.wait()) == want


def test_greedy_default_model_equals_unbatched_loop(default_engine: Any) -> None:
    from multiserve.types import SamplingParams

    eng = default_engine
    ref = ReferenceModel(None, max_len=128)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain gravity to a child in one sentence.", "Name a large city in Italy."]
    prompts = [eng.chat_ids([{"role": "user", "content": q}]) for q in questions]
    max_new = 16
    expected = [ref.greedy(p, max_new) for p in prompts]
    eos = set(eng.model_config.eos_token_ids) | {eng.tokenizer.eos_token_id}

    def check(got: Any, want: list[int]) -> None:
        assert list(got.output_ids) == want[:len(got.output_ids)], got.rid
        if got.finish_reason == "stop":  # eos ended it early; the loop ran on past eos
            assert got.output_ids[-1] in eos, got.rid
        else:
            assert len(got.output_ids) == max_new, got.rid

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    col = Collector(eng)
    with held(eng):
        rids = col.submit_all(prompts[:3], params)
        col.submit("n2", prompts[1], params.with_updates(n=2))
    col.wait()
    for rid, want in zip(rids, expected[:3], strict=True):
        check(col.final[(rid, 0)], want)
    for i in range(2):
        assert list(col.ids("n2", i)) == list(col.ids(rids[1]))
    # A later request shares the chat template's system prompt: a prefix-cache hit.
    later = eng.generate(input_ids=prompts[3], sampling_params=params)
    check(later, expected[3])
    assert later.cached_tokens >= 16


def test_the_readme_engine_example_runs(default_engine: Any) -> None:
    """README "First requests": the in-process example, on the suite's default-model engine
    (the same model and plan as `Engine()`'s; greedy outputs do not depend on the buckets)
    in place of the one it builds and shuts down."""
    from readme_examples import readme_block

    code = readme_block("python", "engine = Engine()")
    assert "\nengine = Engine()\n" in code and code.rstrip().endswith("engine.shutdown()")
    code = code.replace("\nengine = Engine()\n", "\n").replace("engine.shutdown()", "")
    namespace: dict[str, Any] = {"engine": default_engine}
    exec(compile(code, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.finished and out.finish_reason == "length" and len(out.output_ids) == 8
    assert out.text.strip()
