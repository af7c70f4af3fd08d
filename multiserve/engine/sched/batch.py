"""What one step computes: its batch rows and the plan of its logits rows. Plain Python.

Invariant: the scheduler builds a `ScheduledBatch` whole (`Scheduler.schedule`) and
nothing writes it afterwards: the rows, their token count and their RowPlan (row_plan.py)
are fixed from then on. What only the launch learns (the token bucket, when it launched)
is the step in flight's (engine/device/device.py `InFlight`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from multiserve.engine.sched.request import Req
from multiserve.engine.sched.row_plan import RowPlan, plan_rows


@dataclass(frozen=True)
class BatchRow:
    req: Req
    start: int  # first position computed by this step
    end: int  # one past the last position computed
    samples: bool  # this row's last token produces a sampled token
    from_prev: bool  # the (single) input token is the previous step's device output
    # a verify row (speculative decoding): the newest token at `start` then these draft
    # tokens; every one of its end - start positions is sampled (`end = start + 1 + k`)
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScheduledBatch:
    rows: tuple[BatchRow, ...]
    num_tokens: int  # sum of the rows' end - start
    plan: RowPlan  # the step's logits rows (`plan_rows(rows)`)
    # decode steps this dispatch runs (EngineConfig.decode_steps_per_dispatch where
    # Scheduler._decode_steps allows it: every row a decode row, each advancing this many
    # positions; else 1); the rows describe the first
    decode_steps: int = 1

    @classmethod
    def of(cls, rows: Sequence[BatchRow], decode_steps: int = 1) -> ScheduledBatch:
        """The batch of `rows`, its token count and its row plan."""
        rows = tuple(rows)
        return cls(rows, sum(r.end - r.start for r in rows), plan_rows(rows), decode_steps)

    @property
    def num_logit_rows(self) -> int:
        return len(self.plan)

    @property
    def speculative(self) -> bool:
        return any(r.draft for r in self.rows)

    @property
    def constrained(self) -> bool:
        """Some row samples under a grammar (its next mask needs this step's token)."""
        return any(r.samples and r.req.grammar is not None for r in self.rows)
