"""The sampler's rows of one step: a RowSpec per logits row of a ScheduledBatch.

Rows 0..len(batch.rows)-1 are the batch's sequences (None for a prefill chunk that samples
nothing); after them one row per prompt token scored (`prompt_rows`, prompt logprobs):
such a row is greedy and asks for the logprob of the prompt token it scores, its sampled
id is ignored (`prompt_row_params`); then one row per draft token of each verify row
(speculative decoding, batch_arrays.py's `verify_rows` order), sampled exactly as decoding
would sample that position: the same params, seed, position, output so far (penalties)
and bans.

A grammar-constrained row carries its packed allowed-token mask, filled here from the
Req's matcher (brought up to the Req's output first: `GrammarState.sync`, a no-op unless
the output changed behind the matcher). Constrained requests never draft, so no verify
row needs a mask.

Invariant: read only (Reqs, params), apart from that sync of a matcher to its own Req's
output; the specs carry everything the sampler needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from multiserve.engine.sampling.host import RowSpec
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.scheduler import ScheduledBatch
from multiserve.engine.sched.stop_rules import StopRules
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


def step_rows(batch: ScheduledBatch, prompt_rows: Sequence[tuple[Req, int]],
              rules: StopRules, mask_words: int = 0) -> tuple[list[RowSpec | None], bool]:
    """(the RowSpecs of every logits row, whether the step must return logprobs).
    `mask_words`: int32 words of a packed token mask (the logits width / 32, rounded up)."""
    specs: list[RowSpec | None] = []
    wants_lp = bool(prompt_rows)
    for row in batch.rows:
        if not row.samples:
            specs.append(None)
            continue
        req = row.req
        k = len(row.draft)
        specs.append(RowSpec(params=req.params, seed=req.seed, sample_index=req.index,
                             position=row.end,
                             output_ids=[*req.output_ids, *row.draft] if k else req.output_ids,
                             prompt_ids=req.prompt_ids, ban_ids=rules.ban_ids(req, k),
                             token_mask=grammar_mask(req, mask_words)))
        wants_lp = wants_lp or req.params.wants_logprobs
    for req, j in prompt_rows:
        specs.append(RowSpec(params=prompt_row_params(req, j), seed=0, sample_index=0,
                             position=j, output_ids=(), prompt_ids=()))
    # a verify row's draft positions (after the prompt rows, in batch order): position
    # start + j + 1 is sampled as decoding would sample it, after draft[:j] was emitted
    for row in batch.rows:
        req = row.req
        for j in range(len(row.draft)):
            specs.append(RowSpec(params=req.params, seed=req.seed, sample_index=req.index,
                                 position=row.start + j + 1,
                                 output_ids=[*req.output_ids, *row.draft[:j]],
                                 prompt_ids=req.prompt_ids, ban_ids=rules.ban_ids(req, j)))
    return specs, wants_lp
