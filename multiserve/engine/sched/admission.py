"""Admission bounds of one engine: how much work may wait for the running batch.

Owns `check_admission(waiting, new, limits)`, run by the engine thread before new
requests join the waiting queue. Two bounds, both from EngineConfig:
- `max_queued_requests`: waiting samples (n counts n times) -> 429 `queue_full`;
- `max_queued_tokens` (default: 32 x the KV pool): the tokens the waiting samples will
  occupy in KV (prompt + max_new_tokens each) -> 503 `kv_overloaded`.
A refusal is an `EngineOverloaded` carrying the reason and a Retry-After hint.

Invariants: a request is admitted or refused whole (all n samples, every prompt of one
`add`); running requests and retracted ones returning to the queue are never refused,
so the bound holds for new work only and nothing accepted is ever dropped; the queue
therefore never grows past the bound plus what retraction moves back into it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from multiserve.config import EngineConfig
from multiserve.engine.sched.request import Req
from multiserve.types import EngineOverloaded

QUEUED_TOKENS_PER_POOL = 32  # default max_queued_tokens, in KV pools


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int
    max_queued_tokens: int
    max_running_requests: int

    @classmethod
    def from_config(cls, cfg: EngineConfig, kv_pool_tokens: int) -> AdmissionLimits:
        tokens = cfg.max_queued_tokens
        return cls(cfg.max_queued_requests,
                   tokens if tokens is not None else QUEUED_TOKENS_PER_POOL * kv_pool_tokens,
                   cfg.max_running_requests)


def demand(req: Req) -> int:
    """KV tokens a waiting sample will hold at its end."""
    return len(req.prompt_ids) + len(req.output_ids) + req.params.max_new_tokens


def check_admission(waiting: Iterable[Req], new: Sequence[Req], limits: AdmissionLimits
                    ) -> None:
    """Raise EngineOverloaded if `new` joining `waiting` would pass a bound."""
    queued = list(waiting)
    retry = max(1, math.ceil((len(queued) + len(new)) / limits.max_running_requests))
    if len(queued) + len(new) > limits.max_queued_requests:
        raise EngineOverloaded(
            f"server overloaded: {len(queued)} request sample(s) already wait and the "
            f"queue holds at most {limits.max_queued_requests} "
            f"(max_queued_requests); this request brings {len(new)}; retry later",
            status=429, reason="queue_full", retry_after=retry)
    tokens = sum(demand(r) for r in queued)
    extra = sum(demand(r) for r in new)
    if queued and tokens + extra > limits.max_queued_tokens:
        # an empty queue always takes one request (it fits the context, hence the pool)
        raise EngineOverloaded(
            f"server overloaded: the waiting requests already need {tokens} KV tokens and "
            f"this one {extra}; the queue holds at most {limits.max_queued_tokens} "
            f"(max_queued_tokens); retry later",
            status=503, reason="kv_overloaded", retry_after=retry)
