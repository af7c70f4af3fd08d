"""The follower loop: a host other than node 0 runs the spanning engine's device ops.

It builds the same runner as the leader (the leader's invariance plan, dtype and KV pool
size: session.EngineStart), warms up the same programs in the same order, then applies
each device op the leader streams (ops.py), in order, acknowledging each once launched.
It owns no scheduler, server or supervisor: every decision is the leader's.

Invariant: this host runs exactly the leader's device ops, in the leader's order, with
the leader's host inputs; it reads nothing back from its devices.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from multiserve.config import EngineConfig
from multiserve.engine.setup import build_engine_parts
from multiserve.multihost.link import Close, FollowerLink, Sequenced
from multiserve.multihost.ops import apply_op
from multiserve.multihost.session import EngineStart

EXIT_LEADER_LOST = 3


def _say(text: str) -> None:
    print(f"multihost: {text}", file=sys.stderr, flush=True)


def _exit_now(reason: str) -> None:
    """The leader is gone: no device op will come, and a collective in progress can never
    finish, so leave without JAX's exit barrier."""
    _say(f"node lost its leader: {reason}; exiting")
    os._exit(EXIT_LEADER_LOST)


def follow(link: FollowerLink, engine_cfg: EngineConfig, rank: int,
           on_ready: Callable[[], None] | None = None) -> int:
    """Serve as a follower until the leader closes the stream (0) or is lost (exit 3)."""
    link.start_watch(_exit_now)
    try:
        first = link.receive()
    except (OSError, ConnectionError) as e:
        _exit_now(str(e))
    if isinstance(first, Close):
        return 0
    assert isinstance(first, Sequenced) and isinstance(first.body, EngineStart), first
    start: EngineStart = first.body
    link.ack(first.seq)
    cfg = engine_cfg.with_updates(invariance_plan=start.invariance_plan, dtype=start.dtype,
                                  max_total_tokens=start.max_total_tokens,
                                  compile_in_background=False,
                                  decode_steps_per_dispatch=1)
    t0 = time.monotonic()
    parts = build_engine_parts(cfg)
    _say(f"node {rank} follows the engine on devices {list(cfg.device_indexes)} "
         f"(warm-up {time.monotonic() - t0:.1f} s)")
    if on_ready is not None:
        on_ready()
    ops = 0
    while True:
        try:
            msg: Any = link.receive()
        except (OSError, ConnectionError) as e:
            _exit_now(f"the step stream closed ({e})")
        if isinstance(msg, Close):
            _say(f"node {rank}: the leader closed the slice after {ops} device ops")
            return 0
        if isinstance(msg.body, EngineStart):  # never sent twice (restarts are refused)
            _exit_now("the leader started the engine again: restart the whole slice")
        apply_op(parts.runner, msg.body)
        link.ack(msg.seq)
        ops += 1
