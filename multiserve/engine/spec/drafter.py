"""Drafter: proposes each decoding request's draft tokens and learns where drafting pays.

Two sources, both n-gram lookups (ngram_index.py): the request's own prompt + output
("prompt lookup") and the finished outputs of earlier requests with the same prompt
(group_store.py: GRPO siblings, earlier epochs). The longer match wins (then the longer
draft, then the group). A request whose drafts keep missing backs off, counted in its own
generated tokens (so no call has to tick it): after a verify that accepted nothing it
drafts again only 2^misses tokens later, after a lookup that found nothing 2^(dry-1)
tokens later (up to MAX_BACKOFF and MAX_DRY).

The `DraftSource` protocol is what the scheduler calls; tests plug in other sources (an
oracle, an adversary): the accept rule makes the output independent of the drafts.
Owned by the engine thread (the scheduler calls it while scheduling and recording).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from multiserve.engine.sched.request import Req
from multiserve.engine.spec.group_store import GroupStore
from multiserve.engine.spec.ngram_index import NgramIndex

MAX_BACKOFF = 32  # tokens without drafts after repeated misses, at most
MAX_DRY = 4  # tokens between lookups after repeated lookups that found nothing, at most
PRIOR_ACCEPTANCE = 0.5  # a request's per-token acceptance before its first verify
RATE_EWMA = 0.3


class DraftSource(Protocol):
    def wants(self, req: Req) -> bool:
        """Whether `req` may draft at its next decode (cheap: no lookup)."""
        ...

    def propose(self, req: Req, k: int) -> tuple[int, ...]:
        """Up to k draft tokens to follow `req.fill_ids` (all known: nothing pending)."""
        ...

    def acceptance(self, req: Req) -> float:
        """The estimated chance that `req`'s next draft token is accepted, given the ones
        before it were."""
        ...

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """A verify of `proposed` draft tokens of `req` accepted the first `accepted`."""
        ...

    def finished(self, req: Req) -> None:
        """`req` ended: its output may serve later requests of the same prompt."""
        ...


@dataclass
class _ReqState:
    ngrams: NgramIndex
    indexed: int = 0  # fill_ids[:indexed] are in `ngrams`
    rate: float = PRIOR_ACCEPTANCE  # per-token acceptance, a moving average
    misses: int = 0  # verifies in a row that accepted nothing
    dry: int = 0  # lookups in a row that found no draft
    resume_at: int = 0  # no draft until the request has generated this many tokens
    proposed: int = 0
    accepted: int = 0


class Drafter:
    def __init__(self, store: GroupStore | None = None, min_n: int = 2, max_n: int = 4) -> None:
        self.store = store if store is not None else GroupStore(min_n=min_n, max_n=max_n)
        self.min_n, self.max_n = min_n, max_n
        self._reqs: dict[tuple[str, int], _ReqState] = {}

    def _state(self, req: Req) -> _ReqState:
        st = self._reqs.get(req.key)
        if st is None:
            st = self._reqs[req.key] = _ReqState(NgramIndex(self.min_n, self.max_n))
        return st

    def wants(self, req: Req) -> bool:
        """Not backed off, and a lookup on the tokens known now (the newest may still be
        on the device) finds a continuation: then a draft is likely once it is read."""
        st = self._state(req)
        if req.num_generated < st.resume_at:
            return False
        return bool(self._lookup(req, st, 2))

    def _lookup(self, req: Req, st: _ReqState, k: int) -> tuple[int, ...]:
        fill = req.fill_ids
        if len(fill) < st.indexed:  # cannot shrink while live; be safe after a reset
            st.ngrams, st.indexed = NgramIndex(self.min_n, self.max_n), 0
        st.ngrams.extend(fill[st.indexed:])
        st.indexed = len(fill)
        context = fill[-self.max_n:]
        own_n, own = st.ngrams.propose(context, k)
        group = self.store.index_for(req.prompt_ids)
        grp_n, grp = group.propose(context, k) if group is not None else (0, ())
        return grp if grp and (grp_n, len(grp)) >= (own_n, len(own)) else own

    def propose(self, req: Req, k: int) -> tuple[int, ...]:
        st = self._state(req)
        if req.num_generated < st.resume_at:
            return ()
        draft = self._lookup(req, st, k)
        if draft:
            st.dry = 0
        else:  # nothing matches now: look again after a few tokens, then fewer often
            st.dry += 1
            st.resume_at = req.num_generated + min(2 ** (st.dry - 1), MAX_DRY)
        return draft

    def acceptance(self, req: Req) -> float:
        st = self._reqs.get(req.key)
        return PRIOR_ACCEPTANCE if st is None else st.rate

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        st = self._state(req)
        st.proposed += proposed
        st.accepted += accepted
        # tokens checked: the accepted ones and the first rejected one (if any)
        checked = accepted + (1 if accepted < proposed else 0)
        if checked:
            st.rate = (1 - RATE_EWMA) * st.rate + RATE_EWMA * (accepted / checked)
        if accepted == 0:  # skip the next 2^misses tokens' chances to draft
            st.misses += 1
            st.resume_at = req.num_generated + min(2 ** st.misses, MAX_BACKOFF)
        else:
            st.misses = 0

    def finished(self, req: Req) -> None:
        self._reqs.pop(req.key, None)
        if req.output_ids:
            self.store.add(req.prompt_ids, req.output_ids)
