"""The JAX weight transfer of one engine: SGLang's weights-update group, backend "jax".

Owns `TransferGroups` (one per engine): the named groups this engine joined, each a
connection from this process's transfer server (`jax.experimental.transfer`, started at
the first join and shared by the engines of the process) to a trainer's transfer server,
and `pull()`, which fetches the arrays a trainer offered under a uuid (its
`TransferServer.await_pull(uuid, arrays)`) onto one device of this engine. What is pulled
is then staged by the caller like any tensors (engine/rl/weights.py: validated, cast to the
served dtype, checked for NaN/inf, placed, published under a version).

How jax's transfer behaves (jax 0.10, checked on the CPU backend), and what follows here:
- `connect()` is lazy: it never reaches the trainer, so a join cannot check the trainer is
  there; the first pull does.
- One offer serves one pull: a trainer offers the arrays once per engine that pulls them
  (the supervisor's engine i pulls `transfer_uuid + i`: fleet/supervisor_rl.py).
- A pull of a uuid nobody offered (or from a trainer that is gone) waits forever (its own
  timeout argument is not honoured): `pull` bounds it by `timeout_s`, after which the
  connection is poisoned (its pending pull fails) and replaced by a fresh one.
- A pull trusts the shapes and dtypes it asks for: bytes are not described on the wire
  (a (4, 3) asked of a (3, 4) offer arrives reshaped; a size mismatch fails). The names,
  shapes and dtypes of the body are checked against the served model before any pull
  (checks.ParamLayout.check_specs); that they are what the trainer offered is the
  trainer's (multiserve/rl/jax_weight_sender.py sends both from the same arrays).

Invariant: touches no engine state (runs on the caller's thread, off the engine thread);
a failed pull leaves the group joined (with a fresh connection) and changes nothing else.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from multiserve.engine.rl.checks import WeightUpdateError

PULL_TIMEOUT_S = 300.0  # the longest one pull may take before it is failed

_servers: dict[tuple[int, str], Any] = {}  # (id(client), local host) -> TransferServer
_servers_lock = threading.Lock()


def transfer_server(client: Any, host: str) -> Any:
    """This process's transfer server for `client` bound to `host` (started once)."""
    from jax.experimental import transfer

    key = (id(client), host)
    with _servers_lock:
        srv = _servers.get(key)
        if srv is None:
            addr = f"[{host}]:0" if ":" in host else f"{host}:0"
            srv = transfer.start_transfer_server(client, addr, [addr])
            _servers[key] = srv
        return srv


def local_host_towards(host: str) -> str:
    """The address of this host's interface that routes to `host` (no packet is sent):
    the address the trainer's server can reach this engine's server at."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "::1" if host == "::1" else "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return str(s.getsockname()[0])
    except (OSError, UnicodeError) as e:
        raise WeightUpdateError(f"master_address {host!r}: cannot be resolved or routed "
                                f"to ({e})") from None


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class Group:
    """One joined group: the trainer's address, this process's server, the connection
    (replaced after a failed pull), one pull at a time."""

    def __init__(self, name: str, trainer: str, server: Any) -> None:
        self.name, self.trainer, self.server = name, trainer, server
        try:
            self.connection = server.connect(trainer)
        except Exception as e:  # noqa: BLE001 - jax's error, reported as the join's
            raise WeightUpdateError(f"cannot connect to {trainer}: {e}") from None
        self.pulls = 0
        self._lock = threading.Lock()

    def pull(self, uuid: int, specs: list[jax.ShapeDtypeStruct], timeout_s: float
             ) -> list[jax.Array]:
        with self._lock:
            conn = self.connection
            fired = threading.Event()
            timer = threading.Timer(timeout_s, _poison, (conn, fired))
            timer.start()
            try:
                got = conn.pull(uuid, specs)
                jax.block_until_ready(got)
            except Exception as e:  # noqa: BLE001 - jax's runtime error, reported
                self.connection = self.server.connect(self.trainer)  # a fresh one
                why = (f"nothing arrived within {timeout_s:g} s (was uuid {uuid} "
                       "offered, once per pulling engine?)" if fired.is_set() else str(e))
                raise WeightUpdateError(f"pull of uuid {uuid} from {self.trainer} (group "
                                        f"{self.name!r}) failed: {why}") from None
            finally:
                timer.cancel()
            if fired.is_set():  # the timer fired as the pull ended: that connection is poisoned
                self.connection = self.server.connect(self.trainer)
            self.pulls += 1
            return list(got)


class TransferGroups:
    """The weights-update groups of one engine (see module docstring); `devices`: the
    engine's devices (pulls land on its first device of this process)."""

    def __init__(self, devices: Any, timeout_s: float = PULL_TIMEOUT_S) -> None:
        local = [d for d in devices if d.process_index == jax.process_index()]
        self.device = local[0]
        self.timeout_s = timeout_s
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()

    def join(self, group_name: str, master_address: str, master_port: int) -> dict[str, Any]:
        """Open (or reopen) group `group_name` to the trainer at master_address:port."""
        host = master_address.strip("[]")
        trainer = f"[{host}]:{master_port}" if ":" in host else f"{host}:{master_port}"
        server = transfer_server(self.device.client, local_host_towards(host))
        group = Group(group_name, trainer, server)
        with self._lock:
            replaced = group_name in self._groups
            self._groups[group_name] = group
        return {"group_name": group_name, "backend": "jax", "trainer_address": trainer,
                "transfer_address": server.address(), "replaced": replaced}

    def leave(self, group_name: str) -> bool:
        """Drop group `group_name` (its connection closes when released); whether it
        existed."""
        with self._lock:
            return self._groups.pop(group_name, None) is not None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def get(self, group_name: str) -> Group:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"group_name: no weights update group {group_name!r} "
                                    "(init_weights_update_group with backend \"jax\" first)")
        return group

    def pull(self, group_name: str, uuid: int, names: tuple[str, ...],
             dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]
             ) -> dict[str, jax.Array]:
        """The arrays the group's trainer offered under `uuid`, on this engine's device,
        by name (WeightUpdateError when the pull fails or takes over timeout_s)."""
        group = self.get(group_name)
        sharding = SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(tuple(s), np_dtype(d), sharding=sharding)
                 for d, s in zip(dtypes, shapes, strict=True)]
        got = group.pull(uuid, specs, self.timeout_s)
        return dict(zip(names, got, strict=True))


def _poison(conn: Any, fired: threading.Event) -> None:
    """Fail the connection's pending pull (jax's pull waits forever otherwise)."""
    fired.set()
    poison = getattr(conn, "_poison_connection", None)
    if poison is not None:
        poison()
