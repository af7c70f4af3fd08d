"""DraftPlanner: which decode rows of a step verify a draft, and how many draft tokens.

The scheduler asks it (engine/sched/scheduler.py): `wants_drafts` before scheduling (may
the next step verify drafts: then the step in flight is read first), `drafts` while
scheduling (a draft per decode row). The scheduler keeps everything else: the pages a
draft's positions need (it may shorten a draft where they cannot be had), the Reqs' state,
and whether a prompt's prefill takes the step instead (no drafts then).

A draft per request comes from the draft source (drafter.py's `DraftSource`; None: no
speculation), at most speculative_num_draft_tokens, never past max_new_tokens or the
context; then as many draft tokens, most promising first (the request's acceptance **
position), as maximise the expected tokens per second of the step by its bucket's
measured cost (step_costs.py), within speculative_max_step_tokens and the largest row
bucket. It also keeps the engine's speculation totals (get_internal_state's
spec_verify_ct, spec_proposed_tokens, spec_accepted_tokens).

Owned by the engine thread; plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from multiserve.config import EngineConfig
from multiserve.engine.sched.request import Req
from multiserve.engine.spec.drafter import DraftSource
from multiserve.engine.spec.step_costs import StepCosts

if TYPE_CHECKING:
    from multiserve.engine.sched.batch import BatchRow


class DraftPlanner:
    def __init__(self, cfg: EngineConfig, max_rows: int, max_context: int,
                 source: DraftSource | None = None) -> None:
        self.source = source  # None: speculation off
        self.max_draft = cfg.speculative_num_draft_tokens
        self.max_step_rows = min(cfg.speculative_max_step_tokens, max_rows)
        self.max_context = max_context
        # measured step costs by token bucket (the engine thread records every step read)
        self.step_costs = StepCosts(cfg.precompile_token_paddings)
        self.spec_verify_ct = 0  # verify rows run, draft tokens proposed / accepted
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0

    @property
    def on(self) -> bool:
        return self.source is not None

    def set_source(self, source: DraftSource | None) -> None:
        """Draft from `source` from the next step on (None: speculation off)."""
        self.source = source

    # ---- asked while scheduling ----------------------------------------------------
    def wants_drafts(self, decoding: Sequence[Req]) -> bool:
        """Whether a step of the decoding Reqs `decoding` could verify drafts: one may
        draft (not backed off, unconstrained), the step has room, and by the measured
        bucket costs some draft token would pay at the Reqs' acceptance."""
        room = self._room(len(decoding))
        if self.source is None or not decoding or room <= 0:
            return False
        gains = sorted((self._gain(r, j) for r in decoding if self._may_draft(r)
                        for j in range(self.max_draft)), reverse=True)
        return bool(gains) and self.step_costs.best_draft_count(
            len(decoding), len(decoding), gains[:room]) > 0

    def drafts(self, rows: Sequence[BatchRow]) -> list[tuple[int, ...]]:
        """The draft each of the decode rows `rows` (one token each) should verify, in
        row order (empty: none). Only rows whose tokens are all known draft."""
        out: list[tuple[int, ...]] = [() for _ in rows]
        base = len(rows)
        room_total = self._room(base)
        if self.source is None or room_total <= 0:
            return out
        cands: list[tuple[int, tuple[int, ...]]] = []  # (row index, its full draft)
        for i, row in enumerate(rows):
            req = row.req
            room = min(self.max_draft, room_total,
                       req.params.max_new_tokens - req.num_generated - 1,
                       self.max_context - row.end - 1)
            if room <= 0 or row.from_prev or req.pending > 0 or not self._may_draft(req):
                continue
            draft = tuple(self.source.propose(req, room))[:room]
            if draft:
                cands.append((i, draft))
        if not cands:
            return out
        gains = sorted(((self._gain(rows[i].req, j), -j, c)
                        for c, (i, draft) in enumerate(cands) for j in range(len(draft))),
                       reverse=True)
        take = min(room_total, self.step_costs.best_draft_count(
            base, base, [g for g, _, _ in gains]))
        counts = [0] * len(cands)
        for _, _, c in gains[:take]:
            counts[c] += 1
        for (i, draft), k in zip(cands, counts, strict=True):
            out[i] = draft[:k]
        return out

    def _room(self, decode_rows: int) -> int:
        """Draft tokens a step of `decode_rows` decode rows may still carry."""
        return self.max_step_rows - decode_rows

    def _may_draft(self, req: Req) -> bool:
        """Not backed off, and not constrained: a constrained request's verify rows would
        each need the mask after their draft prefix."""
        assert self.source is not None
        return req.grammar is None and self.source.wants(req)

    def _gain(self, req: Req, j: int) -> float:
        """The expected tokens the j-th draft token of `req` adds: the chance the first j+1
        are all accepted, by the request's per-token acceptance."""
        assert self.source is not None
        return min(max(self.source.acceptance(req), 0.0), 1.0) ** (j + 1)

    # ---- told after a step is read -------------------------------------------------
    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        """A verify row of `req` checked `proposed` draft tokens and accepted `accepted`."""
        self.spec_verify_ct += 1
        self.spec_proposed_tokens += proposed
        self.spec_accepted_tokens += accepted
        if self.source is not None:
            self.source.record(req, proposed, accepted)

    def finished(self, req: Req) -> None:
        """`req` ended (its output may serve later drafts)."""
        if self.source is not None:
            self.source.finished(req)
