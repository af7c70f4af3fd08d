"""MultiHostConfig: where this process stands in a slice of several hosts.

SGLang's names: `nnodes` hosts, this one `node_rank` (0 is the leader), the JAX
coordinator at `dist_init_addr` ("HOST:PORT", served by node 0). The leader's step
stream listens on the coordinator's port + 1 (`stream_port`).

Invariant: a config with nnodes == 1 is the one-host server exactly (nothing starts).
"""

from __future__ import annotations

from dataclasses import dataclass

from multiserve.config import ConfigError


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


@dataclass(frozen=True)
class MultiHostConfig:
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # a follower that sends nothing (no ack, no heartbeat) for this long is dead
    heartbeat_timeout_s: float = 10.0
    # every host must have joined within this long of the leader starting
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require(isinstance(self.nnodes, int) and not isinstance(self.nnodes, bool)
                 and self.nnodes >= 1, "nnodes", f"must be an integer >= 1, got {self.nnodes!r}")
        _require(isinstance(self.node_rank, int) and not isinstance(self.node_rank, bool)
                 and 0 <= self.node_rank < self.nnodes, "node_rank",
                 f"must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1:
            _require(self.dist_init_addr is not None, "dist_init_addr",
                     "is required with nnodes > 1 (HOST:PORT of node 0's coordinator)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            _require(bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65535,
                     "dist_init_addr", f"must be HOST:PORT with a port in [1, 65534] (the step "
                     f"stream takes PORT + 1), got {self.dist_init_addr!r}")
        _require(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", "must be > 0")
        _require(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def host(self) -> str:
        assert self.dist_init_addr is not None
        return self.dist_init_addr.rpartition(":")[0].strip("[]")

    @property
    def coordinator_port(self) -> int:
        assert self.dist_init_addr is not None
        return int(self.dist_init_addr.rpartition(":")[2])

    @property
    def stream_port(self) -> int:
        """The leader's step stream (followers connect to it)."""
        return self.coordinator_port + 1
