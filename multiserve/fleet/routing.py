"""The front door's routing policy (no jax, no I/O): which engine serves a request.

Owns `Router`: for each request, given which engines may take work now, the engine it
goes to and why, in this order:
1. sticky: the request names a session (`session`) pinned to an engine that may take
   work: that engine. A session whose engine may not (paused, asleep, unhealthy) is
   placed again by 2-3 and pinned there.
2. prefix: the engine that was sent the longest prefix of this request's prompt key, if
   that covers at least `cache_threshold` of the key and the load is balanced (the
   busiest eligible engine has at most `balance_abs_threshold` more requests in flight
   than the idlest, or at most `balance_rel_threshold` times as many); ties go to the
   least loaded. (sglang-router's cache_aware policy, on the prompt as the clients sent
   it: chat messages, prompt text or token ids.)
3. least loaded: the eligible engine with the fewest requests in flight through this
   router, then the fewest pinned sessions, then the lowest index.
The key of a request's prompt starts with its cache keys (cache_salt, extra_key), so a
keyed request only follows prefixes of its own namespace, as the engine's cache does.

`PrefixIndex` (one per engine): the prompt keys sent there, as a chain of hashes of
`chunk_chars`-character chunks (hash i covers the key's first i chunks), LRU-bounded at
`index_chunks` entries; `matched(chain)` is how many leading chunks it holds. An
approximation of the engine's cache, as sglang-router's tree is: the engine may have
evicted what the index still lists; a wrong guess costs a recompute, never an output.

The tunables are `RoutingConfig`'s (multiserve/config.py: FleetConfig.routing).

Invariants: routing never changes what a request computes (the engine it reaches runs it
as its own port would); only the event loop of the front door calls a Router (no locks);
sessions are LRU-bounded at `max_sessions`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from multiserve.config import RoutingConfig

Reason = Literal["sticky", "prefix", "least_loaded"]
REASONS: tuple[Reason, ...] = ("sticky", "prefix", "least_loaded")


def prefix_chain(key: str, chunk_chars: int) -> list[int]:
    """Hash i covers key[:chunk_chars * (i + 1)] (only whole chunks: a partial last chunk
    is not a shared prefix yet)."""
    chain: list[int] = []
    h = 0
    for start in range(0, len(key) - chunk_chars + 1, chunk_chars):
        h = hash((h, key[start:start + chunk_chars]))
        chain.append(h)
    return chain


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def matched(self, chain: Sequence[int]) -> int:
        n = 0
        for h in chain:
            if h not in self._chunks:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[int]) -> None:
        for h in chain:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._chunks)


@dataclass
class Decision:
    engine: int
    reason: Reason
    matched_chars: int = 0


@dataclass
class RouterStats:
    routed: list[int] = field(default_factory=list)  # per engine
    by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    repinned: int = 0  # sessions moved off an engine that could not take work


class Router:
    def __init__(self, num_engines: int, policy: RoutingConfig | None = None) -> None:
        self.policy = policy or RoutingConfig()
        self.num_engines = num_engines
        self.in_flight = [0] * num_engines
        self.indexes = [PrefixIndex(self.policy.index_chunks) for _ in range(num_engines)]
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> engine, LRU first
        self.pinned = [0] * num_engines  # sessions pinned to each engine
        self.stats = RouterStats(routed=[0] * num_engines)

    def choose(self, eligible: Sequence[int], key: str, session: str | None) -> Decision:
        """The engine for a request (`eligible`: the engines that may take work now, not
        empty). Records the decision: the session pin, the key in the engine's index,
        one more request in flight there (`done` takes it back)."""
        assert eligible, "choose() needs an engine that may take work"
        chain = prefix_chain(key, self.policy.chunk_chars)
        decision = None
        if session is not None:
            pinned = self.sessions.get(session)
            if pinned is not None and pinned in eligible:
                decision = Decision(pinned, "sticky")
            elif pinned is not None:
                self.stats.repinned += 1
        if decision is None:
            decision = self._by_prefix(eligible, chain, len(key)) or self._least_loaded(
                eligible)
        if session is not None:
            self._pin(session, decision.engine)
        self.indexes[decision.engine].insert(chain)
        self.in_flight[decision.engine] += 1
        self.stats.routed[decision.engine] += 1
        self.stats.by_reason[decision.reason] += 1
        return decision

    def done(self, engine: int) -> None:
        self.in_flight[engine] -= 1

    def finish_session(self, session: str) -> bool:
        """Forget a session (prime-rl / SkyRL's /finish_session); True iff it was pinned."""
        engine = self.sessions.pop(session, None)
        if engine is not None:
            self.pinned[engine] -= 1
        return engine is not None

    def _pin(self, session: str, engine: int) -> None:
        old = self.sessions.get(session)
        if old is not None:
            self.pinned[old] -= 1
        self.sessions[session] = engine
        self.sessions.move_to_end(session)
        self.pinned[engine] += 1
        while len(self.sessions) > self.policy.max_sessions:
            _, evicted = self.sessions.popitem(last=False)
            self.pinned[evicted] -= 1

    def _balanced(self, eligible: Sequence[int]) -> bool:
        loads = [self.in_flight[i] for i in eligible]
        lo, hi = min(loads), max(loads)
        p = self.policy
        return hi - lo <= p.balance_abs_threshold or hi <= lo * p.balance_rel_threshold

    def _by_prefix(self, eligible: Sequence[int], chain: Sequence[int], key_len: int
                   ) -> Decision | None:
        if not chain or not self._balanced(eligible):
            return None
        matched = {i: self.indexes[i].matched(chain) for i in eligible}
        best = max(matched.values())
        chars = best * self.policy.chunk_chars
        if best == 0 or chars < self.policy.cache_threshold * key_len:
            return None
        ties = [i for i in eligible if matched[i] == best]
        if len(ties) == len(eligible):  # every engine has it: nothing to prefer
            return None
        return Decision(self._least_loaded(ties).engine, "prefix", chars)

    def _least_loaded(self, eligible: Sequence[int]) -> Decision:
        engine = min(eligible, key=lambda i: (self.in_flight[i], self.pinned[i], i))
        return Decision(engine, "least_loaded")
