"""A step's results (a part of the Scheduler, engine/sched/scheduler.py), once the host read
them: each sampling row's token with its logprobs and weight version, and its stop verdict
(StopRules, the grammar), which finishes the Req (`postprocess`); a verify row's accepted
drafts, its rejected positions' K/V dropped (`_verify`); the K tokens a row of a dispatch
of K decode steps sampled, in order up to the first that ends the sample
(`postprocess_decode_steps`). Plain Python (never imports jax).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.page_allocator import pages_needed
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.state import SchedulerState
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.types import (
    FinishReason,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
    WeightSegment,
)

log = logging.getLogger(__name__)


class StepLogprobSource(Protocol):
    """A step's logprobs read to the host (engine/sampling/logprobs.StepLogprobs)."""

    def token(self, b: int, tok: int, params: SamplingParams) -> TokenLogprob: ...

    def prompt(self, b: int, token: int, params: SamplingParams) -> TokenLogprob: ...


class Postprocess(SchedulerState):
    def postprocess(self, batch: ScheduledBatch, next_ids: Sequence[int],
                    logprobs: StepLogprobSource | None, weight_version: str,
                    rules: StopRules) -> list[Req]:
        """Record the results of launched step `batch`: prompt logprobs of its prompt
        rows, and per sampling row its token (with logprob record and weight version)
        and the stop verdict (finishing the Req). Returns the Reqs with output to deliver
        now (finished, or streaming), in row order."""
        for i in batch.plan.prompt_rows:
            req, j = batch.plan.rows[i].req, batch.plan.rows[i].j
            if not req.finished and len(req.prompt_logprobs) == j:
                assert logprobs is not None, "prompt rows always return logprobs"
                req.prompt_logprobs.append(logprobs.prompt(i, req.prompt_ids[j], req.params))
        for row in batch.rows:  # the table holds these rows' ids now (core._process)
            if not row.req.finished:
                row.req.routed_read = max(row.req.routed_read, row.end)
        deliver: list[Req] = []
        for b, row in enumerate(batch.rows):
            req = row.req
            if not row.samples or req.finished:
                continue
            if row.draft:
                if self._verify(batch, b, next_ids, logprobs, weight_version, rules):
                    deliver.append(req)
                continue
            req.pending -= 1
            if req.params.max_new_tokens == 0:  # scoring: the prompt is done, no token
                self.finish(req, "length")
                deliver.append(req)
                continue
            tok = int(next_ids[b])
            self._record_token(req, tok, logprobs, b, weight_version)
            reason, matched = rules.verdict(req, tok)
            if reason is None and req.grammar is not None:
                reason = self._grammar_verdict(req, tok)
            elif req.grammar is not None:
                req.grammar.advance(tok)
            if reason is not None:
                req.matched_stop = matched
                self.finish(req, reason)
                deliver.append(req)
            elif req.stream:
                deliver.append(req)
        return deliver

    def postprocess_decode_steps(self, batch: ScheduledBatch,
                                 step_ids: Sequence[Sequence[int]],
                                 logprobs: Sequence[StepLogprobSource] | None,
                                 weight_version: str, rules: StopRules) -> list[Req]:
        """`postprocess` of a dispatch that ran `batch.decode_steps` decode steps
        (`step_ids[k]`: the ids step k sampled, by row; `logprobs[k]`: its logprobs). Each
        row's tokens are recorded in order, each judged by the stop rules as a single
        step's is, until one ends the sample: the tokens after it were sampled past the end
        and are dropped, and the finish gives back its pages, K/V past the end included.
        Returns the Reqs with output to deliver now, in row order."""
        deliver: list[Req] = []
        for b, row in enumerate(batch.rows):
            req = row.req
            if req.finished:
                continue
            req.routed_read = max(req.routed_read, row.end + batch.decode_steps - 1)
            req.pending -= batch.decode_steps
            for k in range(batch.decode_steps):
                tok = int(step_ids[k][b])
                self._record_token(req, tok, logprobs[k] if logprobs is not None else None,
                                   b, weight_version)
                reason, matched = rules.verdict(req, tok)
                if reason is not None:
                    req.matched_stop = matched
                    self.finish(req, reason)
                    deliver.append(req)
                    break
            else:
                if req.stream:
                    deliver.append(req)
        return deliver

    @staticmethod
    def _grammar_verdict(req: Req, tok: int) -> FinishReason | None:
        """Advance a constrained Req's matcher by its new token: "stop" once the grammar
        is complete (nothing but EOS allowed), "abort" with `req.error` naming the token if
        it rejects it (only a token the mask allowed can be sampled, so this is a broken
        grammar state, e.g. a resumed output the grammar never admitted)."""
        assert req.grammar is not None
        if not req.grammar.advance(tok):
            req.error = f"the grammar rejected token {tok}: {req.grammar.error}"
            log.warning("request %s: %s", req.rid, req.error)
            return "abort"
        return "stop" if req.grammar.done else None

    def _record_token(self, req: Req, tok: int, logprobs: StepLogprobSource | None,
                      logits_row: int, weight_version: str) -> None:
        """One emitted token of `req`: its id, the weight version it came from, its
        logprob record (from logits row `logits_row`) where asked for."""
        req.output_ids.append(tok)
        if not req.weight_segments or \
                req.weight_segments[-1].weight_version != weight_version:
            req.weight_segments.append(WeightSegment(len(req.output_ids) - 1, weight_version))
        if logprobs is not None and req.params.wants_logprobs:
            req.output_logprobs.append(logprobs.token(logits_row, tok, req.params))

    def _verify(self, batch: ScheduledBatch, b: int, next_ids: Sequence[int],
                logprobs: StepLogprobSource | None, weight_version: str,
                rules: StopRules) -> bool:
        """Record verify row b: the samples at its positions in order, each one emitted,
        until one differs from its draft token (emitted in its place) or ends the sample;
        all drafts accepted: the sample after the last one too. K/V of the positions not
        kept (rejected drafts) is dropped: kv_len moves back and pages past it are freed,
        so nothing rejected reaches the prefix cache. Returns whether to deliver now."""
        row = batch.rows[b]
        req, draft = row.req, row.draft
        k = len(draft)
        req.pending -= 1
        holds_kv = req.status is RequestStatus.RUNNING  # not retracted meanwhile
        if holds_kv:
            req.kv_len = row.start  # then one more per emitted token
        accepted = 0
        ended = False
        for j in range(k + 1):
            logits_row = batch.plan.verify_row(b, j) if j < k else b
            tok = int(next_ids[logits_row])
            if holds_kv:
                req.kv_len += 1
            self._record_token(req, tok, logprobs, logits_row, weight_version)
            reason, matched = rules.verdict(req, tok)
            if reason is not None:
                req.matched_stop = matched
                if j < k and tok == draft[j]:
                    accepted += 1
                self.finish(req, reason)
                ended = True
                break
            if j == k or tok != draft[j]:
                break
            accepted += 1
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.planner.verified(req, k, accepted)
        if holds_kv and not ended:
            keep = pages_needed(req.kv_len, self.page_size)
            if len(req.pages) > keep:
                assert keep >= req.num_cached_pages
                self.allocator.free(req.pages[keep:])
                del req.pages[keep:]
        return ended or req.stream
