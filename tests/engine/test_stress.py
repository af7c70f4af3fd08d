"""Stress and compile-stability runs on the tiny engines (issue 3): many mixed requests with
aborts in the middle lose no request, give every sample exactly one final output, leak no
KV page (checked by the autouse memory-integrity fixture), and never recompile.
"""

from __future__ import annotations

import random
import time
from typing import Any

from engine_helpers import TINY_VOCAB, Collector, ReferenceModel, held

from multiserve.types import SamplingParams


def _params(rng: random.Random, max_new_range: tuple[int, int]) -> SamplingParams:
    max_new = rng.randrange(*max_new_range)
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.7, top_k=40, seed=rng.randrange(1000),
                              max_new_tokens=max_new, ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, n=2,
                              seed=rng.randrange(1000), max_new_tokens=max_new)
    if kind == 3:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new, frequency_penalty=0.5,
                              repetition_penalty=1.2, stop_token_ids=[rng.randrange(3, 60)],
                              min_new_tokens=min(2, max_new), return_logprob=True)
    return SamplingParams(temperature=0.5, max_new_tokens=max_new, top_logprobs_num=2,
                          seed=rng.randrange(1000), presence_penalty=0.3)


def _stress(engine: Any, num: int, seed: int, aborts: int, max_prompt: int = 120,
            max_new_range: tuple[int, int] = (1, 25)) -> tuple[Collector, dict, set]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(24)]
    work = {}
    for i in range(num):
        n = rng.randrange(1, max_prompt)
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
        if i % 5 == 0:
            prompt = shared + prompt[:rng.randrange(1, 20)]  # prefix-cache traffic
        work[f"s{i}"] = (prompt, _params(rng, max_new_range))
    col = Collector(engine)
    with held(engine):
        for rid, (prompt, params) in work.items():
            col.submit(rid, prompt, params)
    aborted: set[str] = set()
    for rid in rng.sample(sorted(work), aborts):
        time.sleep(rng.random() * 0.02)
        if engine.abort_request(rid).details["aborted"]:
            aborted.add(rid)
    col.wait()
    return col, work, aborted


def _check(col: Collector, work: dict, aborted: set, eos: set[int]) -> None:
    expected = {(rid, i) for rid, (_, p) in work.items() for i in range(p.n)}
    assert set(col.final) == expected  # no request lost, none invented
    # an abort that found its request running ended at least one of its samples
    assert all(any(out.finish_reason == "abort" for (r, _), out in col.final.items()
                   if r == rid) for rid in aborted)
    for (rid, _), out in col.final.items():
        prompt, p = work[rid]
        assert out.prompt_tokens == len(prompt)
        if rid in aborted and out.finish_reason == "abort":
            continue  # (a sample of an aborted request may have finished before the abort)
        assert out.error is None
        assert 1 <= len(out.output_ids) <= p.max_new_tokens, rid
        if out.finish_reason == "length":
            assert len(out.output_ids) == p.max_new_tokens, rid
        else:
            assert out.finish_reason == "stop", (rid, out.finish_reason)
            last = out.output_ids[-1]
            assert last in p.stop_token_ids or (not p.ignore_eos and last in eos), rid
            assert len(out.output_ids) >= p.min_new_tokens
        if p.wants_logprobs:
            assert len(out.logprobs) == len(out.output_ids)


def test_stress_200_requests_with_aborts(tiny_engine: Any, tiny_model_dir: Any) -> None:
    before = tiny_engine.get_internal_state()
    col, work, aborted = _stress(tiny_engine, 200, seed=0, aborts=20)
    eos = set(tiny_engine.model_config.eos_token_ids) | {tiny_engine.tokenizer.eos_token_id}
    _check(col, work, aborted, eos)
    st = tiny_engine.get_internal_state()
    assert st["cache_miss_count"] == 0
    assert st["forward_ct"] > before["forward_ct"]
    # Spot-check greedy outputs against the unbatched loop.
    ref = ReferenceModel(str(tiny_model_dir))
    greedy = [rid for rid, (_, p) in work.items() if rid not in aborted
              and p.temperature == 0 and not p.stop_token_ids][:6]
    assert greedy
    for rid in greedy:
        prompt, p = work[rid]
        assert list(col.ids(rid)) == ref.greedy(prompt, p.max_new_tokens), rid


def test_stress_under_kv_pressure(tiny_engine_pressure: Any, tiny_engine: Any) -> None:
    """A 256-token pool: admission waits and decode retracts all the time; outputs still
    equal those of the roomy engine (same seeds)."""
    retractions = tiny_engine_pressure.get_internal_state()["num_retractions"]
    kw: dict[str, Any] = dict(num=40, seed=1, aborts=0, max_prompt=60, max_new_range=(20, 60))
    col, work, _ = _stress(tiny_engine_pressure, **kw)
    assert tiny_engine_pressure.get_internal_state()["num_retractions"] > retractions
    roomy, _, _ = _stress(tiny_engine, **kw)
    eos = set(tiny_engine.model_config.eos_token_ids) | {tiny_engine.tokenizer.eos_token_id}
    _check(col, work, set(), eos)
    assert {k: o.output_ids for k, o in col.final.items()} == \
        {k: o.output_ids for k, o in roomy.final.items()}
