"""RowPlan: which logits row of a step holds which logits: the one place the layout of a
step's logits rows is worked out (`plan_rows`). Plain Python (never imports jax).

A step computes one logits row per entry of its plan, in this order:
1. SEQUENCE rows: row b is batch row b's last token (the token the row samples, if it
   samples at all), for every batch row, in batch order;
2. PROMPT_LOGPROB rows: for each batch row in batch order, one per prompt token j whose
   logprob the chunk computes (`Req.prompt_logprob_targets`), in prompt order: the logits
   at position j - 1, scoring prompt token j;
3. VERIFY rows: for each verify row (speculative decoding) in batch order, one per draft
   token j, in draft order: the logits at position `start + j`, whose sample draft token
   j is checked against (the token after the last draft comes from the SEQUENCE row).

Invariants: a plan is immutable and built from the batch rows alone (and their Reqs'
prompt logprob progress, which only the host's read of a step advances, never between a
schedule and its launch); `len(plan)` is the step's logits row count; every row's `token`
is the index of the step's flat token row whose logits it holds.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from multiserve.engine.sched.request import Req


class PlannedRow(Protocol):
    """What the plan reads of a batch row (engine/sched/batch.py `BatchRow`)."""

    @property
    def req(self) -> Req: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def draft(self) -> tuple[int, ...]: ...


class RowKind(enum.Enum):
    SEQUENCE = "sequence"
    PROMPT_LOGPROB = "prompt_logprob"
    VERIFY = "verify"


@dataclass(frozen=True, slots=True)
class LogitRow:
    kind: RowKind
    b: int  # the batch row it belongs to
    req: Req
    # PROMPT_LOGPROB: the prompt index it scores; VERIFY: the draft index it checks;
    # SEQUENCE: -1
    j: int
    token: int  # the step's flat token row whose logits it holds


def prompt_targets(row: PlannedRow) -> range:
    """The prompt indexes whose logprobs batch row `row` computes (one logits row each)."""
    return row.req.prompt_logprob_targets(row.start, row.end)


def logit_rows_of(row: PlannedRow) -> int:
    """How many logits rows batch row `row` takes: its own, one per prompt logprob it
    computes, one per draft token it verifies."""
    if not row.req.want_prompt_logprobs:  # (no prompt targets: the common row, fast)
        return 1 + len(row.draft)
    return 1 + len(prompt_targets(row)) + len(row.draft)


@dataclass(frozen=True)
class RowPlan:
    rows: tuple[LogitRow, ...]
    num_sequences: int  # rows[:num_sequences] are the SEQUENCE rows, row b for batch row b
    prompt_rows: tuple[int, ...] = field(init=False)  # the PROMPT_LOGPROB rows, in order
    token_rows: tuple[int, ...] = field(init=False)  # per logits row, its `token`
    _verify: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows, extra = self.rows, range(self.num_sequences, len(self.rows))
        prompt = tuple(i for i in extra if rows[i].kind is RowKind.PROMPT_LOGPROB)
        verify = {(rows[i].b, rows[i].j): i for i in extra if rows[i].kind is RowKind.VERIFY}
        object.__setattr__(self, "prompt_rows", prompt)
        object.__setattr__(self, "token_rows", tuple(r.token for r in rows))
        object.__setattr__(self, "_verify", verify)

    def __len__(self) -> int:
        return len(self.rows)

    def verify_row(self, b: int, j: int) -> int:
        """The logits row that checks draft token j of verify row b."""
        return self._verify[(b, j)]


def plan_rows(rows: Sequence[PlannedRow]) -> RowPlan:
    """The logits rows of a step of batch rows `rows` (their tokens laid out back to back,
    in order); see the module docstring for the layout."""
    seq: list[LogitRow] = []
    prompt: list[LogitRow] = []
    verify: list[LogitRow] = []
    t = 0  # the first token row of batch row b
    for b, row in enumerate(rows):
        req = row.req
        seq.append(LogitRow(RowKind.SEQUENCE, b, req, -1, t + row.end - row.start - 1))
        for j in prompt_targets(row) if req.want_prompt_logprobs else ():
            prompt.append(LogitRow(RowKind.PROMPT_LOGPROB, b, req, j, t + j - 1 - row.start))
        for j in range(len(row.draft)):
            verify.append(LogitRow(RowKind.VERIFY, b, req, j, t + j))
        t += row.end - row.start
    return RowPlan((*seq, *prompt, *verify), len(seq))
