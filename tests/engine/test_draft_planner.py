"""DraftPlanner (engine/spec/planner.py): which decode rows verify a draft and how many
draft tokens, asked by the scheduler; it keeps the speculation totals. Pure Python (no jax):
a scripted draft source and scripted step costs stand in for the n-gram drafter and the
measured buckets."""

from __future__ import annotations

from collections.abc import Sequence

from multiserve.config import EngineConfig
from multiserve.engine.sched.batch import BatchRow
from multiserve.engine.sched.request import Req
from multiserve.engine.spec.planner import DraftPlanner
from multiserve.engine.spec.step_costs import StepCosts
from multiserve.types import SamplingParams


class Script:
    """Drafts `drafts[rid]` (cut to what is asked); acceptance by rid; records calls."""

    def __init__(self, drafts: dict[str, tuple[int, ...]],
                 acceptance: dict[str, float] | None = None) -> None:
        self.drafts, self.rates = drafts, acceptance or {}
        self.asked: list[tuple[str, int]] = []
        self.records: list[tuple[str, int, int]] = []
        self.ended: list[str] = []

    def wants(self, req: Req) -> bool:
        return req.rid in self.drafts

    def propose(self, req: Req, k: int) -> tuple[int, ...]:
        self.asked.append((req.rid, k))
        return self.drafts[req.rid][:k]

    def acceptance(self, req: Req) -> float:
        return self.rates.get(req.rid, 0.5)

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        self.records.append((req.rid, proposed, accepted))

    def finished(self, req: Req) -> None:
        self.ended.append(req.rid)


class Pays:
    """Step costs under which the first `n` draft tokens offered pay (None: all)."""

    overlap, host_seconds = True, 0.0

    def __init__(self, n: int | None = None) -> None:
        self.n = n
        self.asked: list[Sequence[float]] = []

    def best_draft_count(self, base_tokens: int, base_rows: int,
                         gains: Sequence[float]) -> int:
        self.asked.append(list(gains))
        return len(gains) if self.n is None else min(self.n, len(gains))


def _planner(source: Script | None, costs: object, *, k: int = 4, step: int = 64,
             max_context: int = 100) -> DraftPlanner:
    cfg = EngineConfig(page_size=4, speculative_num_draft_tokens=k,
                       speculative_max_step_tokens=step)
    planner = DraftPlanner(cfg, max_rows=64, max_context=max_context, source=source)
    planner.step_costs = costs  # type: ignore[assignment]
    return planner


def _decode_row(rid: str, *, out: int = 2, max_new: int = 20, from_prev: bool = False,
                pending: int = 0) -> BatchRow:
    req = Req(rid, 0, [1, 2, 3, 4], SamplingParams(max_new_tokens=max_new), 0,
              lambda o: None)
    req.output_ids = list(range(5, 5 + out))
    req.pending = pending
    pos = len(req.fill_ids) - 1 + pending
    return BatchRow(req, pos, pos + 1, samples=True, from_prev=from_prev)


def test_each_row_gets_its_draft_where_its_tokens_are_known_and_room_allows() -> None:
    src = Script({"a": (7, 7, 7, 7, 7), "b": (8, 8), "c": (9,), "d": (6, 6), "e": (5, 5, 5)})
    planner = _planner(src, Pays())
    rows = [_decode_row("a"),  # up to k = 4
            _decode_row("b", from_prev=True, pending=1),  # its input is still on the device
            _decode_row("c"),
            _decode_row("x"),  # the source has nothing for it
            # a verify row of k draft tokens emits up to k + 1: never past max_new_tokens
            _decode_row("d", out=19),  # one token left: this step's own, no draft
            _decode_row("e", out=18)]  # two left: a 1-token draft
    assert planner.drafts(rows) == [(7, 7, 7, 7), (), (9,), (), (), (5,)]
    assert ("b", 4) not in src.asked and all(rid != "d" for rid, _ in src.asked)


def test_the_step_costs_choose_the_most_promising_draft_tokens() -> None:
    """Gains are acceptance ** (j + 1): where three tokens pay, a's three (0.9, 0.81,
    0.729) beat b's first (0.5)."""
    src = Script({"a": (1, 2, 3), "b": (4, 5)}, {"a": 0.9, "b": 0.5})
    costs = Pays(3)
    planner = _planner(src, costs)
    assert planner.drafts([_decode_row("a"), _decode_row("b")]) == [(1, 2, 3), ()]
    assert costs.asked == [[0.9, 0.81, 0.9 ** 3, 0.5, 0.25]]
    # the step's room (speculative_max_step_tokens less its decode rows) caps them too
    planner = _planner(src, Pays(), step=4)
    assert planner.drafts([_decode_row("a"), _decode_row("b")]) == [(1, 2), ()]


def test_no_drafts_without_a_source_room_or_a_measured_payoff() -> None:
    rows = [_decode_row("a")]
    assert _planner(None, Pays()).drafts(rows) == [()]
    assert not _planner(None, Pays()).wants_drafts([rows[0].req])
    src = Script({"a": (1, 2)})
    assert _planner(src, Pays(), step=1).drafts(rows) == [()]
    unmeasured = StepCosts((8, 16))  # no bucket measured yet: no draft pays
    assert _planner(src, unmeasured).drafts(rows) == [()]
    assert not _planner(src, unmeasured).wants_drafts([rows[0].req])
    assert _planner(src, Pays()).wants_drafts([rows[0].req])
    assert not _planner(Script({}), Pays()).wants_drafts([rows[0].req])


def test_verifies_are_counted_and_told_to_the_source() -> None:
    src = Script({})
    planner = _planner(src, Pays())
    a, b = _decode_row("a").req, _decode_row("b").req
    planner.verified(a, 4, 2)
    planner.verified(b, 3, 0)
    planner.finished(a)
    assert (planner.spec_verify_ct, planner.spec_proposed_tokens,
            planner.spec_accepted_tokens) == (2, 7, 2)
    assert src.records == [("a", 4, 2), ("b", 3, 0)] and src.ended == ["a"]
    planner.set_source(None)  # off: the totals stay, nothing is told
    planner.verified(a, 1, 1)
    assert planner.spec_verify_ct == 3 and len(src.records) == 2 and not planner.on
