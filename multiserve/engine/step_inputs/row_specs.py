"""The sampler's rows of one step: a RowSpec per logits row of a ScheduledBatch, in the
order of its RowPlan (engine/sched/row_plan.py).

A SEQUENCE row samples its batch row's next token (None for a prefill chunk that samples
nothing); a PROMPT_LOGPROB row is greedy and asks for the logprob of the prompt token it
scores, its sampled id is ignored (`prompt_row_params`); a VERIFY row (speculative
decoding) is sampled exactly as decoding would sample its position: the same params,
seed, position, output so far (penalties) and bans.

A grammar-constrained row carries its packed allowed-token mask, filled here from the
Req's matcher (brought up to the Req's output first: `GrammarState.sync`, a no-op unless
the output changed behind the matcher). Constrained requests never draft, so no verify
row needs a mask.

Invariant: read only (Reqs, params), apart from that sync of a matcher to its own Req's
output; the specs carry everything the sampler needs.
"""

from __future__ import annotations

import numpy as np

from multiserve.engine.base.frozen_build import built
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.row_plan import RowKind
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.step_inputs.sampling_batch import RowSpec
from multiserve.types import SamplingParams


def prompt_row_params(req: Req, j: int) -> SamplingParams:
    """The made-up sampling of the row that scores prompt token j of `req`: greedy, one
    token, the request's top-k, and the logprob of that prompt token."""
    return SamplingParams(temperature=0.0, max_new_tokens=1,
                          top_logprobs_num=req.params.top_logprobs_num,
                          token_ids_logprob=(req.prompt_ids[j],))


def grammar_mask(req: Req, words: int) -> np.ndarray | None:
    """The packed allowed tokens of `req`'s next token (None: unconstrained)."""
    if req.grammar is None:
        return None
    row = np.zeros(words, np.int32)
    req.grammar.sync(req.output_ids)
    req.grammar.fill(row)
    return row


def step_rows(batch: ScheduledBatch, rules: StopRules,
              mask_words: int = 0) -> tuple[list[RowSpec | None], bool]:
    """(the RowSpecs of every logits row of `batch.plan`, whether the step must return
    logprobs). `mask_words`: int32 words of a packed token mask (the logits width / 32,
    rounded up)."""
    specs: list[RowSpec | None] = []
    wants_lp = False
    for lr in batch.plan.rows:
        req = lr.req
        if lr.kind is RowKind.PROMPT_LOGPROB:
            specs.append(RowSpec(params=prompt_row_params(req, lr.j), seed=0, sample_index=0,
                                 position=lr.j, output_ids=(), prompt_ids=()))
            wants_lp = True
            continue
        row = batch.rows[lr.b]
        if lr.kind is RowKind.VERIFY:
            # draft position start + j + 1, sampled as decoding would sample it after
            # draft[:j] was emitted
            specs.append(RowSpec(params=req.params, seed=req.seed, sample_index=req.index,
                                 position=row.start + lr.j + 1,
                                 output_ids=[*req.output_ids, *row.draft[:lr.j]],
                                 prompt_ids=req.prompt_ids, ban_ids=rules.ban_ids(req, lr.j)))
            continue
        if not row.samples:
            specs.append(None)
            continue
        k = len(row.draft)
        # (one per sampling row per step: `built`, engine/base/frozen_build.py)
        specs.append(built(RowSpec, params=req.params, seed=req.seed, sample_index=req.index,
                           position=row.end,
                           output_ids=[*req.output_ids, *row.draft] if k else req.output_ids,
                           prompt_ids=req.prompt_ids, ban_ids=rules.ban_ids(req, k),
                           token_mask=(grammar_mask(req, mask_words)
                                       if req.grammar is not None else None)))
        wants_lp = wants_lp or req.params.sampler_fields.wants_logprobs
    return specs, wants_lp
