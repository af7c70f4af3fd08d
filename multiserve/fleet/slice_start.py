"""The fleet on a slice of several hosts (FleetConfig.multihost; multiserve/multihost/).

Every host runs the same `multiserve serve ... --nnodes N --node-rank R --dist-init-addr
HOST:PORT`. Before JAX starts, `form_slice` sets this host's virtual device count (CPU)
and forms the slice (multihost/session.py: the hosts agree on the fleet config, then JAX
initialises over all of them). Node 0 then launches the fleet as on one host (its engines
take GLOBAL device indexes); every other node runs `follow_fleet`: the follower loop of
the one engine holding its devices.

On the leader, a lost follower (`watch_slice`) makes that engine unhealthy at once
(/health 503, its requests fail with the reason, new ones are refused), and the process
exits (status 3) `heartbeat_timeout_s` later, without JAX's exit barrier: the engine
thread may be inside a collective the lost host will never join.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from typing import Any

from multiserve.config import ConfigError, FleetConfig
from multiserve.multihost.session import SliceSession, start_slice

EXIT_SLICE_LOST = 3


def _say(text: str) -> None:
    print(f"multihost: {text}", file=sys.stderr, flush=True)


def devices_per_host(cfg: FleetConfig) -> int:
    """Each host's device count on CPU (virtual devices): the fleet's devices over nnodes."""
    return -(-cfg.device_count_needed // cfg.multihost.nnodes)


def agreed_fields(cfg: FleetConfig) -> dict[str, str]:
    """What every host's config must equal, by field: the fleet config, node_rank aside."""
    from multiserve.multihost.fingerprint import flat_fields

    return flat_fields(replace(cfg, multihost=replace(cfg.multihost, node_rank=0)))


def form_slice(cfg: FleetConfig) -> SliceSession:
    """Prepare the platform and join the slice (before anything touches a device)."""
    if cfg.platform in ("cpu", "auto"):
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                       f"{devices_per_host(cfg)}").strip()
    if cfg.platform != "auto":
        os.environ.setdefault("JAX_PLATFORMS", cfg.platform)
    mh = cfg.multihost
    _say(f"node {mh.node_rank}/{mh.nnodes}: joining the slice at {mh.dist_init_addr} "
         f"(step stream port {mh.stream_port})")
    session = start_slice(mh, agreed_fields(cfg))
    import jax

    _say(f"node {mh.node_rank}: slice formed: {jax.device_count()} devices, "
         f"{jax.local_device_count()} here")
    return session


def spanning_engine(cfg: FleetConfig) -> int | None:
    """The index of the one engine holding a device of this (follower) host, or None."""
    import jax

    mine = {d.id for d in jax.local_devices()}
    devices = jax.devices()
    holders = [i for i, e in enumerate(cfg.engines)
               if any(devices[d].id in mine for d in e.device_indexes)]
    if len(holders) > 1:
        raise ConfigError("engines", f"engines {holders} each hold devices of node "
                          f"{cfg.multihost.node_rank}: at most one engine may span hosts")
    return holders[0] if holders else None


def follow_fleet(cfg: FleetConfig, session: SliceSession) -> int:
    """A follower host: run the follower loop of its engine until the leader closes."""
    from multiserve.fleet.follower import follow

    assert session.follower is not None
    index = spanning_engine(cfg)
    rank = cfg.multihost.node_rank
    if index is None:
        raise ConfigError("engines", f"no engine holds a device of node {rank}: its devices "
                          "would idle (give an engine device indexes on every host)")
    _say(f"node {rank}: following engines[{index}] (devices "
         f"{list(cfg.engines[index].device_indexes)})")
    return follow(session.follower, cfg.engines[index], rank,
                  on_ready=lambda: print(f"FOLLOWING: node={rank} engine={index}",
                                         flush=True))


def watch_slice(session: SliceSession, workers: list[Any]) -> None:
    """The leader: on a lost follower, make every engine spanning hosts unhealthy, then
    exit (module doc)."""
    from multiserve.multihost.session import spans_hosts

    assert session.leader is not None
    grace = session.cfg.heartbeat_timeout_s

    def lost(reason: str) -> None:
        _say(f"LOST: {reason}; the engine spanning hosts is unhealthy; exiting in "
             f"{grace:.0f} s")
        for w in workers:
            engine = w.engine
            if engine is not None and spans_hosts(list(engine.devices)):
                engine.mark_unhealthy(f"a host of this engine's slice was lost: {reason}")
        timer = threading.Timer(grace, lambda: (_say("exiting: slice lost"),
                                                os._exit(EXIT_SLICE_LOST)))
        timer.daemon = True
        timer.start()

    session.leader.add_on_lost(lost)
