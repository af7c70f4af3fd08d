"""End-to-end generation truths of the engine (issue 3), with real forward passes.

- Greedy output equals the model's plain unbatched greedy loop for a mixed batch
  (ragged prompt lengths, chunked prefill, prefix-cache hits, n > 1), on a tiny random
  model (the embedded default model's case is in test_determinism.py, beside the other
  tests of the shared default engine: one default engine per test process).
- Seeded sampling does not depend on batch composition or on the sample's neighbours.
- Overlap scheduling on and off give identical outputs.
- Retraction under KV pressure completes every request with the unpressured output.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, Collector, ReferenceModel, held

from multiserve.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Any) -> ReferenceModel:
    return ReferenceModel(str(tiny_model_dir))


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Ragged lengths (1 .. 150 tokens: several chunks at chunked_prefill_size=32), and
    prompts sharing a 40-token prefix (prefix-cache hits, within and across batches)."""
    rng = random.Random(seed)
    shared = _prompt(rng, 40)
    prompts = [_prompt(rng, n) for n in (1, 2, 7, 16, 33, 64, 150)]
    prompts += [shared + _prompt(rng, n) for n in (1, 5, 30)]
    prompts += [shared[:17]]
    return prompts


def test_greedy_mixed_batch_equals_unbatched_loop(tiny_engine: Any,
                                                  tiny_reference: ReferenceModel) -> None:
    prompts = mixed_prompts()
    expected = [tiny_reference.greedy(p, GREEDY.max_new_tokens) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)  # outputs depend on context
    col = Collector(tiny_engine)
    with held(tiny_engine):
        rids = col.submit_all(prompts, GREEDY)
        col.submit("n3", prompts[8], GREEDY.with_updates(n=3))  # n > 1 shares the prompt KV
    col.wait()
    for rid, want in zip(rids, expected, strict=True):
        got = col.final[(rid, 0)]
        assert list(got.output_ids) == want, rid
        assert got.finish_reason == "length" and got.completion_tokens == 24
    for i in range(3):
        assert list(col.ids("n3", i)) == expected[8]

    # Second wave: the same prompts again hit the prefix cache and must not change.
    st = tiny_engine.get_internal_state()
    assert st["tree_cache_size"] > 0
    col2 = Collector(tiny_engine)
    rids2 = col2.submit_all(prompts, GREEDY, prefix="again")
    col2.wait()
    hits = 0
    for rid, want in zip(rids2, expected, strict=True):
        got = col2.final[(rid, 0)]
        assert list(got.output_ids) == want, rid
        hits += got.cached_tokens
        assert got.cached_tokens <= got.prompt_tokens - 1  # the last token is recomputed
    assert hits >= 100


def _sampled(seed: int, **kw: Any) -> SamplingParams:
    args: dict[str, Any] = dict(temperature=0.9, top_p=0.95, top_k=200, seed=seed,
                                max_new_tokens=20, ignore_eos=True)
    return SamplingParams(**{**args, **kw})


def test_seeded_sampling_independent_of_batch_composition(tiny_engine: Any) -> None:
    rng = random.Random(1)
    target = _prompt(rng, 21)
    alone = tiny_engine.generate(input_ids=target, sampling_params=_sampled(7))
    assert alone.finish_reason == "length"

    # In a crowd: different neighbours, row position, chunked prefill of others.
    col = Collector(tiny_engine)
    with held(tiny_engine):
        for i in range(9):
            col.submit(f"before{i}", _prompt(rng, rng.randrange(1, 90)),
                       _sampled(100 + i) if i % 2 else GREEDY)
        col.submit("target", target, _sampled(7))
        col.submit("n4", target, _sampled(7, n=4))  # sample 0 is the same draw sequence
        for i in range(5):
            col.submit(f"after{i}", _prompt(rng, rng.randrange(1, 90)), _sampled(200 + i))
    col.wait()
    assert col.ids("target") == alone.output_ids
    assert col.ids("n4", 0) == alone.output_ids
    samples = {col.ids("n4", i) for i in range(4)}
    assert len(samples) == 4  # the sample index keys the draws: samples differ

    other_seed = tiny_engine.generate(input_ids=target, sampling_params=_sampled(8))
    assert other_seed.output_ids != alone.output_ids


def _mixed_workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    work = []
    for i in range(14):
        p = _prompt(rng, rng.randrange(1, 100))
        kind = i % 4
        if kind == 0:
            params = GREEDY
        elif kind == 1:
            params = _sampled(i, min_p=0.01)
        elif kind == 2:
            params = GREEDY.with_updates(frequency_penalty=-1.5, presence_penalty=0.5,
                                         repetition_penalty=0.8, return_logprob=True)
        else:
            params = _sampled(i, frequency_penalty=1.0, n=2, top_logprobs_num=3)
        work.append((p, params))
    return work


def _run(engine: Any, work: list[tuple[list[int], SamplingParams]]) -> dict:
    col = Collector(engine)
    with held(engine):
        for i, (p, params) in enumerate(work):
            col.submit(f"w{i}", p, params)
    return {k: (o.output_ids, o.finish_reason, o.logprobs) for k, o in col.wait().items()}


def test_overlap_on_and_off_give_identical_outputs(tiny_engine: Any,
                                                   tiny_engine_no_overlap: Any) -> None:
    assert tiny_engine.get_internal_state()["overlap"] is True
    assert tiny_engine_no_overlap.get_internal_state()["overlap"] is False
    work = _mixed_workload(3)
    with_overlap = _run(tiny_engine, work)
    without = _run(tiny_engine_no_overlap, work)
    assert with_overlap.keys() == without.keys()
    for key in with_overlap:
        ids_a, reason_a, lp_a = with_overlap[key]
        ids_b, reason_b, lp_b = without[key]
        assert (ids_a, reason_a) == (ids_b, reason_b), key
        if lp_a is not None:
            assert [t.token_id for t in lp_a] == list(ids_a)
            assert lp_a == lp_b, key  # bit for bit: same numerics with and without overlap


def test_retract_under_kv_pressure_keeps_outputs(tiny_engine: Any,
                                                 tiny_engine_pressure: Any) -> None:
    """A 256-token pool cannot hold 8 requests of 52 tokens: decode must retract (and
    re-prefill) some of them; every request still completes with the same output."""
    rng = random.Random(5)
    work = [(_prompt(rng, 20), GREEDY.with_updates(max_new_tokens=32, return_logprob=True)
             if i % 2 else _sampled(i, max_new_tokens=32, return_logprob=True))
            for i in range(8)]
    before = tiny_engine_pressure.get_internal_state()["num_retractions"]
    pressured = _run(tiny_engine_pressure, work)
    after = tiny_engine_pressure.get_internal_state()["num_retractions"]
    assert after > before, "the pool was not small enough to force a retraction"
    free = _run(tiny_engine, work)
    assert pressured == free  # ids and logprobs, bit for bit
    assert all(reason == "length" for _, reason, _ in pressured.values())


def test_requests_filling_the_whole_context_and_pool(tiny_engine_pressure: Any,
                                                     tiny_reference: ReferenceModel) -> None:
    """Context == pool == 256 tokens: a prompt plus max_new_tokens of exactly 256 uses
    every page; one token more is refused with the field named."""
    eng = tiny_engine_pressure
    assert eng.context_len == 256
    rng = random.Random(8)
    for prompt_len in (200, 255):
        prompt = _prompt(rng, prompt_len)
        max_new = 256 - prompt_len
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY.with_updates(
            max_new_tokens=max_new))
        assert out.finish_reason == "length"
        assert list(out.output_ids) == tiny_reference.greedy(prompt, max_new)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(input_ids=_prompt(rng, 200), sampling_params=GREEDY.with_updates(
            max_new_tokens=57))
