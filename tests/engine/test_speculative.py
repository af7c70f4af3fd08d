"""Speculative decoding cannot change an output: with n-gram drafts, an oracle's (always
right), an adversary's (always wrong) or none, every sample's ids AND logprobs are bitwise
those of the engine without speculation: greedy and seeded, top-k/top-p/min-p, all three
penalties, n > 1, stop ids / stop strings / EOS / max_new_tokens falling inside a draft,
min_new_tokens bans, each pause mode and abort + resubmit in the middle of a draft. After
each test the autouse fixture checks the page accounting (`check_integrity`) and that a
flush gives every KV token back."""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Oracle, Trigger

from multiserve.engine.commands import Call
from multiserve.engine.spec.drafter import Drafter
from multiserve.engine.spec.group_store import GroupStore
from multiserve.engine.spec.ngram_index import SEPARATOR, NgramIndex
from multiserve.engine.spec.step_costs import StepCosts
from multiserve.types import SamplingParams

MAX_NEW = 24
Key = tuple[str, int]


# ---- the drafters alone (no device) -------------------------------------------------------

def test_ngram_index_proposes_what_followed_the_latest_earlier_match() -> None:
    idx = NgramIndex(2, 4)
    idx.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    # the longest suffix n-gram (4: [6, 1, 2, 3]) never occurred before; [1, 2, 3] did,
    # latest at 5..8, followed by 5, 6
    assert idx.propose([6, 1, 2, 3], 2) == (3, (5, 6))
    assert idx.propose([6, 1, 2, 3], 9) == (3, (5, 6, 1, 2, 3))
    assert idx.propose([7, 8], 3) == (0, ())
    assert idx.propose([1, 2], 0) == (0, ())
    # the sequence's own final n-gram is never its own match
    solo = NgramIndex(2, 2)
    solo.extend([4, 5])
    assert solo.propose([4, 5], 3) == (0, ())
    # no match or continuation crosses a separator
    seg = NgramIndex(2, 3)
    seg.extend([1, 2, 3, SEPARATOR, 7, 1, 2])
    assert seg.propose([7, 1, 2], 4) == (2, (3,))
    seg.extend([SEPARATOR, 2])
    assert seg.propose([SEPARATOR, 2], 4) == (0, ())


def test_group_store_is_bounded_and_least_recently_used_goes_first() -> None:
    store = GroupStore(max_bytes=20_000, min_n=2, max_n=3)
    for p in range(6):
        store.add([100 + p, 1, 2], list(range(10, 40)))
    assert store.approx_bytes <= 20_000 and 0 < len(store) < 6
    assert store.index_for([100, 1, 2]) is None  # the oldest prompt was dropped
    newest = store.index_for([105, 1, 2])
    assert newest is not None and newest.propose([1, 2, 10, 11], 3) == (3, (12, 13, 14))
    # a sample's first tokens match through the prompt's tail
    assert newest.propose([1, 2], 2) == (2, (10, 11))


class _FakeReq:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_ids, self.output_ids = prompt, output
        self.key = ("r", 0)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def test_drafter_prefers_the_group_then_backs_off_where_drafts_miss() -> None:
    d = Drafter()
    seq = list(range(8, 40))
    d.finished(_FakeReq([5, 6, 7], seq))  # type: ignore[arg-type]
    req = _FakeReq([5, 6, 7], seq[:2])
    assert d.wants(req) and d.propose(req, 3) == (10, 11, 12)  # type: ignore[arg-type]
    d.record(req, 3, 0)  # type: ignore[arg-type]
    # a verify that accepted nothing: no draft for the next 2 tokens
    assert not d.wants(req) and d.propose(req, 3) == ()  # type: ignore[arg-type]
    req.output_ids = seq[:3]
    assert not d.wants(req)  # type: ignore[arg-type]
    req.output_ids = seq[:4]
    assert d.wants(req)  # type: ignore[arg-type]
    d.record(req, 2, 0)  # type: ignore[arg-type]
    req.output_ids = seq[:7]
    assert not d.wants(req)  # 4 tokens after a second miss  # type: ignore[arg-type]
    req.output_ids = seq[:8]
    assert d.wants(req) and d.propose(req, 2) == (16, 17)  # type: ignore[arg-type]
    d.record(req, 3, 2)  # type: ignore[arg-type]
    assert d.wants(req) and 0 < d.acceptance(req) < 1  # type: ignore[arg-type]
    # nothing to look up: not wanted (the step in flight keeps its overlap), and a lookup
    # that finds nothing looks again after 1, then 2, 4 tokens at most
    lone = _FakeReq([40, 41], [42])
    lone.key = ("lone", 0)
    assert not d.wants(lone) and d.propose(lone, 3) == ()  # type: ignore[arg-type]
    lone.output_ids.append(43)
    assert d.propose(lone, 3) == ()  # type: ignore[arg-type]
    lone.output_ids.append(44)
    assert d.propose(lone, 3) == ()  # backed off  # type: ignore[arg-type]
    for i in range(8):  # never more than MAX_DRY tokens between lookups
        lone.output_ids += [100 + 4 * i + j for j in range(4)]
        assert d.propose(lone, 3) == ()  # type: ignore[arg-type]
    lone.output_ids += [90, 91, 40, 41]  # the prompt's bigram again: its continuation
    assert d.wants(lone) and d.propose(lone, 3) == (42, 43, 44)  # type: ignore[arg-type]


def test_step_costs_choose_drafts_by_the_measured_bucket_costs() -> None:
    costs = StepCosts((1, 2, 4, 8, 16, 32, 64))
    assert costs.best_draft_count(2, 2, [0.9, 0.8]) == 0  # nothing measured: no drafts
    costs.observe(2, 0.020)
    # unseen larger buckets are assumed nearly as cheap: tried
    assert costs.best_draft_count(2, 2, [0.9, 0.81, 0.73]) == 3
    costs.observe(4, 0.021)
    costs.observe(8, 0.060)  # compute-bound from 8 tokens on
    # 2 rows + 2 drafts fit bucket 4 (cheap); more would need bucket 8 at 3x the cost
    assert costs.best_draft_count(2, 2, [0.9, 0.81, 0.73, 0.66, 0.59, 0.53]) == 2
    assert costs.best_draft_count(3, 3, [0.01, 0.001]) == 0  # under the 10% margin
    assert costs.best_draft_count(3, 3, [0.9, 0.001]) == 1  # within its bucket: free
    costs.observe(4, 0.5)  # the moving average follows a slower bucket 4
    assert costs.cost(4) > 0.021 and costs.best_draft_count(2, 2, [0.9, 0.81]) == 0
    assert costs.bucket(65) is None and costs.best_draft_count(50, 50, [1.0] * 20) == 14
    # with overlap, a step with drafts also pays the host time between steps
    costs.observe(4, 0.021)
    costs.observe(4, 0.021)
    fresh = StepCosts((1, 2, 4))
    fresh.observe(2, 0.020)
    fresh.observe(4, 0.020)
    assert fresh.best_draft_count(2, 2, [0.3, 0.1]) == 2
    fresh.observe_host(0.010)
    assert fresh.best_draft_count(2, 2, [0.3, 0.1]) == 0  # 2.4 / 30 ms < 2 / 20 ms
    fresh.overlap = False  # nothing hidden anyway: drafts pay again
    assert fresh.best_draft_count(2, 2, [0.3, 0.1]) == 2


# ---- the engine ----------------------------------------------------------------------------

@pytest.fixture
def spec_engine(tiny_engine_spec: Any) -> Any:
    return tiny_engine_spec


def _set_drafter(engine: Any, drafter: Any) -> None:
    engine.call(Call(lambda core: core.scheduler.planner.set_source(drafter))).result()


def _work(seed: int, n: int = 6) -> list[tuple[list[int], SamplingParams]]:
    """Repetitive prompts (n-gram drafts find matches) with every sampler feature."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        unit = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 6))]
        prompt = (unit * 12)[:rng.randrange(12, 48)]
        kinds = [
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                           return_logprob=True, top_logprobs_num=2),
            SamplingParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.02, seed=7 + i,
                           max_new_tokens=MAX_NEW, ignore_eos=True, return_logprob=True,
                           frequency_penalty=0.3, presence_penalty=0.2,
                           repetition_penalty=1.1),
            SamplingParams(temperature=0.7, seed=11 + i, n=3, max_new_tokens=MAX_NEW - 5,
                           ignore_eos=True, return_logprob=True),
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, min_new_tokens=6,
                           return_logprob=True, stop_token_ids=(unit[0],)),
        ]
        out.append((prompt, kinds[i % len(kinds)]))
    return out


def _run(engine: Any, work: list[tuple[list[int], SamplingParams]], prefix: str = "r",
         hook: Any = None) -> dict[Key, tuple]:
    col = Collector(engine, on_output=hook)
    col.submit_all([p for p, _ in work], [s for _, s in work], prefix=prefix)
    return {k: (o.output_ids, tuple(o.logprobs or ()), o.finish_reason, o.matched_stop)
            for k, o in col.wait().items()}


def _spec_counts(engine: Any) -> tuple[int, int, int]:
    s = engine.get_internal_state()
    return s["spec_verify_ct"], s["spec_proposed_tokens"], s["spec_accepted_tokens"]


@pytest.fixture(scope="module")
def reference(_tiny_engine: Any) -> dict[int, dict[Key, tuple]]:
    return {}


def _want(engine: Any, cache: dict, seed: int) -> dict[Key, tuple]:
    if seed not in cache:
        cache[seed] = _run(engine, _work(seed))
    return cache[seed]


def test_ngram_speculation_gives_the_outputs_without_it(
        tiny_engine: Any, spec_engine: Any, reference: dict) -> None:
    before = _spec_counts(spec_engine)
    for seed in (0, 1):
        want = _want(tiny_engine, reference, seed)
        assert _run(spec_engine, _work(seed)) == want
    after = _spec_counts(spec_engine)
    assert after[0] > before[0] and after[1] > before[1]  # it did speculate


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_adversary_drafts_give_the_outputs_without_them(
        tiny_engine: Any, spec_engine: Any, reference: dict, wrong: bool) -> None:
    want = _want(tiny_engine, reference, 2)
    oracle = Oracle({k: v[0] for k, v in want.items()}, wrong=wrong)
    _set_drafter(spec_engine, oracle)
    before = _spec_counts(spec_engine)
    assert _run(spec_engine, _work(2)) == want
    verify, proposed, accepted = (a - b for a, b in zip(_spec_counts(spec_engine), before,
                                                        strict=True))
    assert verify > 0 and proposed == oracle.proposed > 0
    if wrong:
        assert accepted == 0
    else:  # all accepted but where a stop ended the sample inside the draft
        assert accepted >= proposed * 0.8, (accepted, proposed)


@pytest.mark.parametrize("min_new", [0, 12])
def test_stop_id_inside_a_draft_and_min_new_tokens_bans(tiny_engine: Any, spec_engine: Any,
                                                         min_new: int) -> None:
    """The stop id is the free run's 9th token (it recurs later); the oracle drafts
    through it. With min_new_tokens 12 the sampler bans it at the draft positions before
    the 12th token, as decoding would, so the sample goes on past it."""
    prompt = [9, 4, 17, 4] * 6
    base = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                          return_logprob=True)
    free = _run(tiny_engine, [(prompt, base)], prefix="s")[("s0", 0)][0]
    params = base.with_updates(stop_token_ids=(free[8],), min_new_tokens=min_new)
    want = _run(tiny_engine, [(prompt, params)], prefix="s")
    _set_drafter(spec_engine, Oracle({("s0", 0): free}))
    assert _run(spec_engine, [(prompt, params)], prefix="s") == want
    ids = want[("s0", 0)][0]
    if min_new == 0:
        assert want[("s0", 0)][2] == "stop" and len(ids) == 9
    else:
        assert len(ids) >= 12


def test_stop_string_inside_a_draft(tiny_engine: Any, spec_engine: Any) -> None:
    prompt = [5, 6, 7, 8] * 6
    base = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                          return_logprob=True)
    free = _run(tiny_engine, [(prompt, base)], prefix="s")[("s0", 0)][0]
    text = tiny_engine.decode(free[5:7], skip_special_tokens=False)
    assert text.strip(), text
    params = base.with_updates(stop=[text])
    want = _run(tiny_engine, [(prompt, params)], prefix="s")
    _set_drafter(spec_engine, Oracle({("s0", 0): free}))
    assert _run(spec_engine, [(prompt, params)], prefix="s") == want
    assert want[("s0", 0)][2] == "stop" and len(want[("s0", 0)][0]) < len(free)


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_mid_draft(tiny_engine: Any, spec_engine: Any, reference: dict, trigger: Trigger,
                         mode: str) -> None:
    want = _want(tiny_engine, reference, 0)
    _set_drafter(spec_engine, Oracle({k: v[0] for k, v in want.items()}))
    hook = AtTokens(trigger, "r0", 9,
                    lambda: spec_engine.acontrol("pause_generation", mode=mode))
    col = Collector(spec_engine, on_output=hook)
    work = _work(0)
    col.submit_all([p for p, _ in work], [s for _, s in work])
    (res,) = hook.wait()
    assert res.ok
    assert spec_engine.continue_generation().ok
    got = col.wait()
    for key, out in got.items():
        ids, lps = want[key][0], want[key][1]
        if mode == "abort" and out.finish_reason == "abort":
            n = len(out.output_ids)
            assert (out.output_ids, tuple(out.logprobs or ())) == (ids[:n], lps[:n])
        else:
            assert (out.output_ids, tuple(out.logprobs or ()), out.finish_reason) == \
                (ids, lps, want[key][2])


def test_abort_and_resubmit_mid_draft(tiny_engine: Any, spec_engine: Any, reference: dict,
                                      trigger: Trigger) -> None:
    """A sample aborted in the middle of a speculated step and resubmitted with its output
    so far appended to the prompt continues exactly as it would have."""
    want = _want(tiny_engine, reference, 1)
    _set_drafter(spec_engine, Oracle({k: v[0] for k, v in want.items()}))
    work = _work(1)
    greedy = next(i for i, (_, p) in enumerate(work) if p.temperature == 0 and p.n == 1
                  and not p.stop_token_ids)
    key = (f"r{greedy}", 0)
    hook = AtTokens(trigger, key[0], 7,
                    lambda: spec_engine.acontrol("abort_request", rid=key[0]))
    col = Collector(spec_engine, on_output=hook)
    col.submit_all([p for p, _ in work], [s for _, s in work])
    hook.wait()
    got = col.wait()
    part = got[key].output_ids
    assert got[key].finish_reason == "abort" and 7 <= len(part) < MAX_NEW
    prompt, params = work[greedy]
    rest = _run(spec_engine, [(prompt + list(part),
                               params.with_updates(max_new_tokens=MAX_NEW - len(part)))],
                prefix="again")[("again0", 0)]
    assert part + rest[0] == want[key][0]


@pytest.mark.parametrize("operation", ["memory", "weights"])
def test_memory_release_and_weight_update_mid_draft(tiny_engine: Any, spec_engine: Any,
                                                    reference: dict, trigger: Trigger,
                                                    tiny_model_dir: Any, operation: str) -> None:
    """Between two speculated steps: memory released (retract) and resumed, or the weights
    updated from disk to the same checkpoint (K/V recomputed, the prefix cache dropped):
    the outputs are those without speculation, bit for bit."""
    want = _want(tiny_engine, reference, 0)
    _set_drafter(spec_engine, Oracle({k: v[0] for k, v in want.items()}))
    if operation == "memory":
        factory = (lambda: spec_engine.acontrol("release_memory_occupation",  # noqa: E731
                                                mode="retract"))
    else:  # a weight update needs the engine paused (retract) first
        factory = (lambda: spec_engine.acontrol("pause_generation",  # noqa: E731
                                                mode="retract"))
    hook = AtTokens(trigger, "r0", 9, factory)
    col = Collector(spec_engine, on_output=hook)
    work = _work(0)
    col.submit_all([p for p, _ in work], [s for _, s in work])
    (res,) = hook.wait()
    assert res.ok, res
    if operation == "memory":
        assert spec_engine.resume_memory_occupation().ok
    else:
        assert spec_engine.update_weights_from_disk(str(tiny_model_dir), "default").ok
        assert spec_engine.continue_generation().ok
    got = col.wait()
    assert {k: (o.output_ids, tuple(o.logprobs or ()), o.finish_reason)
            for k, o in got.items()} == {k: v[:3] for k, v in want.items()}


def test_set_speculation_command_switches_a_fresh_drafter_on_and_off(
        tiny_engine: Any, reference: dict) -> None:
    """SetSpeculation (the bench's switch): on drafts from a fresh n-gram Drafter each
    time, off from none; either way the outputs are those without speculation."""
    from multiserve.engine.commands import SetSpeculation

    def source() -> Any:
        return tiny_engine.call(Call(lambda core: core.scheduler.planner.source)).result()

    want = _want(tiny_engine, reference, 0)
    assert source() is None
    try:
        tiny_engine.call(SetSpeculation(True)).result()
        first = source()
        assert isinstance(first, Drafter)
        assert _run(tiny_engine, _work(0)) == want
        tiny_engine.call(SetSpeculation(True)).result()
        assert isinstance(source(), Drafter) and source() is not first
    finally:
        tiny_engine.call(SetSpeculation(False)).result()
    assert source() is None
    assert _run(tiny_engine, _work(0)) == want
