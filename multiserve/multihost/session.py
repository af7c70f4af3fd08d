"""This process's place in a slice: the link to the other hosts, formed once, before
JAX starts, then `jax.distributed.initialize` (platform.py).

`start_slice` is called once per process by whoever owns start-up (fleet/launch.py, the
follower's main, the tests); `current()` is read by engine set-up (engine/setup.py) to
learn whether an engine spans hosts and, on the leader, where its device ops go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiserve.config import MultiHostConfig
from multiserve.multihost.fingerprint import fingerprint
from multiserve.multihost.link import FollowerLink, LeaderLink
from multiserve.multihost.platform import join_slice


@dataclass(frozen=True)
class EngineStart:
    """The leader's start-up decisions for the spanning engine that every follower must
    take the same: the invariance plan it calibrated, the compute dtype, the KV pool."""
    invariance_plan: Any
    dtype: str
    max_total_tokens: int


@dataclass
class SliceSession:
    cfg: MultiHostConfig
    leader: LeaderLink | None = None
    follower: FollowerLink | None = None


_CURRENT: list[SliceSession] = []


def start_slice(cfg: MultiHostConfig, agreed: dict[str, str]) -> SliceSession:
    """Form the slice (every host says hello with `agreed`, what all hosts must share by
    name, e.g. the fleet config's fingerprint.flat_fields), then initialise JAX over it.
    Once per process."""
    assert not _CURRENT, "the slice is formed once per process"
    mine = {**fingerprint(agreed, cfg.nnodes), "rank": str(cfg.node_rank)}
    session = SliceSession(cfg)
    if cfg.is_leader:
        session.leader = LeaderLink.gather(cfg, mine)
        session.leader.start_watch()  # heartbeats from now on (warm-up sends nothing else)
    else:
        session.follower = FollowerLink.join(cfg, mine)
    join_slice(cfg)
    _CURRENT.append(session)
    return session


def current() -> SliceSession | None:
    return _CURRENT[0] if _CURRENT else None


def spans_hosts(devices: list[Any]) -> bool:
    """Whether an engine on `devices` has devices of another process (host)."""
    import jax

    me = jax.process_index()
    return any(d.process_index != me for d in devices)
