"""The plan of a step's logits rows (engine/sched/row_plan.py): for a mixed batch (decode
rows, prefill chunks with and without prompt logprobs, verify rows) the sequence rows come
first, one per batch row, then one row per prompt logprob position, then one per draft
token; every row names the flat token row whose logits it holds. Pure Python (no jax)."""

from __future__ import annotations

import dataclasses

import pytest

from multiserve.engine.sched.batch import BatchRow, ScheduledBatch
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.row_plan import RowKind, logit_rows_of, plan_rows
from multiserve.types import SamplingParams


def _req(rid: str, prompt_len: int, *, output: int = 0, prompt_logprobs: bool = False,
         scored: int = 0) -> Req:
    """A Req of `prompt_len` prompt tokens and `output` output tokens; with
    `prompt_logprobs`, the logprobs of prompt tokens 1..scored already recorded."""
    req = Req(rid, 0, list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=8), 0,
              lambda out: None)
    req.output_ids = list(range(50, 50 + output))
    req.want_prompt_logprobs = prompt_logprobs
    req.prompt_logprobs = [None] * (1 + scored)
    return req


def _mixed() -> tuple[list[BatchRow], dict[str, Req]]:
    reqs = {"dec": _req("dec", 5, output=2), "ver": _req("ver", 4, output=3),
            "lp1": _req("lp1", 10, prompt_logprobs=True),
            "lp2": _req("lp2", 10, prompt_logprobs=True, scored=6),
            "plain": _req("plain", 9)}
    rows = [
        BatchRow(reqs["dec"], 6, 7, samples=True, from_prev=True),  # tokens 0
        BatchRow(reqs["ver"], 6, 9, samples=True, from_prev=False, draft=(7, 8)),  # 1..3
        BatchRow(reqs["lp1"], 0, 6, samples=False, from_prev=False),  # tokens 4..9
        BatchRow(reqs["lp2"], 6, 10, samples=True, from_prev=False),  # tokens 10..13
        BatchRow(reqs["plain"], 0, 9, samples=True, from_prev=False),  # tokens 14..22
    ]
    return rows, reqs


def test_sequences_then_prompt_logprob_positions_then_draft_tokens() -> None:
    rows, reqs = _mixed()
    plan = plan_rows(rows)
    got = [(r.kind, r.b, r.req.rid, r.j, r.token) for r in plan.rows]
    S, P, V = RowKind.SEQUENCE, RowKind.PROMPT_LOGPROB, RowKind.VERIFY
    assert got == [
        # one per batch row, in batch order: the row's last token
        (S, 0, "dec", -1, 0), (S, 1, "ver", -1, 3), (S, 2, "lp1", -1, 9),
        (S, 3, "lp2", -1, 13), (S, 4, "plain", -1, 22),
        # lp1's chunk [0, 6) scores prompt tokens 1..6 from positions 0..5
        (P, 2, "lp1", 1, 4), (P, 2, "lp1", 2, 5), (P, 2, "lp1", 3, 6), (P, 2, "lp1", 4, 7),
        (P, 2, "lp1", 5, 8), (P, 2, "lp1", 6, 9),
        # lp2's chunk [6, 10) of a 10-token prompt: tokens 7..9 (1..6 were scored before)
        (P, 3, "lp2", 7, 10), (P, 3, "lp2", 8, 11), (P, 3, "lp2", 9, 12),
        # the verify row's draft tokens j, checked by the logits at position start + j
        (V, 1, "ver", 0, 1), (V, 1, "ver", 1, 2),
    ]
    assert len(plan) == 16 and plan.num_sequences == 5
    assert plan.prompt_rows == tuple(range(5, 14))
    assert [plan.verify_row(1, j) for j in range(2)] == [14, 15]
    with pytest.raises(KeyError):
        plan.verify_row(0, 0)  # a decode row verifies nothing
    assert plan.token_rows == tuple(r.token for r in plan.rows)
    assert [logit_rows_of(r) for r in rows] == [1, 3, 7, 4, 1]
    assert all(r.req is reqs[r.req.rid] for r in plan.rows)


def test_a_batch_is_complete_and_immutable_once_built() -> None:
    rows, _ = _mixed()
    batch = ScheduledBatch.of(rows)
    assert batch.num_tokens == 23 and batch.num_logit_rows == 16
    assert batch.speculative and not batch.constrained
    rows.pop()  # the caller's list is not the batch's
    assert len(batch.rows) == 5 and len(batch.plan) == 16
    for obj, name in ((batch, "plan"), (batch.rows[0], "end"), (batch.plan, "rows"),
                      (batch.plan.rows[0], "token")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)


def test_decode_only_and_empty_plans() -> None:
    reqs = [_req(f"d{i}", 3, output=i + 1) for i in range(3)]
    plan = plan_rows([BatchRow(r, 3 + i, 4 + i, True, False) for i, r in enumerate(reqs)])
    assert [(r.kind, r.b, r.token) for r in plan.rows] == [
        (RowKind.SEQUENCE, b, b) for b in range(3)]
    assert plan.prompt_rows == () and len(plan_rows([])) == 0


def test_the_schedulers_batches_carry_the_plan_of_their_rows() -> None:
    """A scheduled step mixing a decode row and a chunk with prompt logprobs: its plan is
    the plan of its rows, within the row budget."""
    from sched_sim import Sim

    sim = Sim(max_tokens=16, max_rows=8)
    a = sim.req("a", range(3, 9), max_new=4)
    sim.add(a)
    sim.step()  # a's prefill; a decodes from now on
    b = sim.req("b", range(20, 40), max_new=2)
    b.want_prompt_logprobs = True
    sim.add(b)
    batch = sim.sched.schedule()
    assert batch is not None
    kinds = [r.kind for r in batch.plan.rows]
    assert batch.plan == plan_rows(batch.rows)
    assert batch.rows[0].req is a and batch.rows[1].req is b
    # a decodes, b's first chunk takes the rows left: one sequence row and one row per
    # prompt position it scores
    assert kinds == [RowKind.SEQUENCE] * 2 + [RowKind.PROMPT_LOGPROB] * 6
    assert batch.num_logit_rows == 8 == sim.sched.max_rows
