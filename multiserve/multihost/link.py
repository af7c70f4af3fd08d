"""The step stream between the leader (node 0) and its followers: one TCP connection a
follower, opened before JAX starts.

Start-up (`LeaderLink.gather` / `FollowerLink.join`): followers connect in any order and
retry until the leader listens; each sends its `fingerprint` (fingerprint.py); the leader
refuses every host whose fingerprint differs (naming the differences, on both sides) and
gives up, naming the ranks that never arrived, after `startup_timeout_s`.

Serving: the leader sends each device operation (ops.py) as one message, in order, to
every follower; a follower acknowledges each once it has launched it. Both sides send a
heartbeat when idle (every `heartbeat_timeout_s / 4`).

Invariant (the bound): a follower is declared lost, and the leader stops sending, within
`heartbeat_timeout_s` (+ one watchdog tick, 0.25 s) of its last message, or of the oldest
operation it has not acknowledged (a process dead, stopped, or stuck). The leader's
`send` raises `FollowerLost` from then on, so it never starts a device operation after
it knows a follower cannot run it. A follower whose leader is silent as long exits.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from multiserve.config import MultiHostConfig
from multiserve.multihost import wire
from multiserve.multihost.fingerprint import differences

WATCH_TICK_S = 0.25
CLOSE_WAIT_S = 10.0  # how long the leader's close waits for its followers to exit


def _drain_until_closed(sock: socket.socket, deadline: float) -> None:
    """Read and drop what `sock` still brings until its peer closes it or `deadline`."""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return
    except OSError:
        return


class FollowerLost(RuntimeError):
    """A follower of this slice died, hung, or left: the spanning engine cannot step."""


class SliceStartError(RuntimeError):
    """The slice could not form: a host never arrived, or two hosts disagree."""


@dataclass(frozen=True)
class Hello:
    rank: int
    fingerprint: dict[str, str]


@dataclass(frozen=True)
class Welcome:
    pass


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Beat:
    pass


@dataclass(frozen=True)
class Ack:
    seq: int


@dataclass(frozen=True)
class Sequenced:
    """A leader's message with its sequence number (acknowledged by `Ack(seq)`)."""
    seq: int
    body: Any


@dataclass(frozen=True)
class Close:
    """The leader shuts down: followers exit cleanly."""


@dataclass
class _Peer:
    rank: int
    sock: socket.socket
    address: str
    last_heard: float
    acked: int = 0
    unacked_since: dict[int, float] = field(default_factory=dict)


class LeaderLink:
    def __init__(self, cfg: MultiHostConfig, peers: list[_Peer]) -> None:
        self.cfg = cfg
        self._peers = peers
        self._lock = threading.Lock()  # one writer at a time: messages never interleave
        self._seq = 0
        self._last_sent = time.monotonic()
        self.lost: str | None = None
        self._on_lost: list[Callable[[str], None]] = []
        self._closed = False
        self.bytes_sent = 0
        self._readers: dict[int, threading.Thread] = {}  # rank -> its stream's reader

    # ---- start-up ------------------------------------------------------------------
    @classmethod
    def gather(cls, cfg: MultiHostConfig, mine: dict[str, str]) -> LeaderLink:
        """Listen on the stream port until every follower has said hello (and agrees)."""
        server = socket.create_server(("", cfg.stream_port), reuse_port=False)
        server.settimeout(WATCH_TICK_S)
        deadline = time.monotonic() + cfg.startup_timeout_s
        peers: dict[int, _Peer] = {}
        try:
            while len(peers) < cfg.nnodes - 1:
                if time.monotonic() > deadline:
                    missing = [r for r in range(1, cfg.nnodes) if r not in peers]
                    raise SliceStartError(
                        f"node(s) {missing} never joined the step stream on port "
                        f"{cfg.stream_port} within {cfg.startup_timeout_s:.0f} s "
                        f"(joined: {sorted(peers) or 'none'})")
                try:
                    sock, addr = server.accept()
                except TimeoutError:
                    continue
                sock.settimeout(cfg.startup_timeout_s)
                hello = wire.receive(sock)
                if not isinstance(hello, Hello) or not 0 < hello.rank < cfg.nnodes:
                    sock.close()
                    continue
                diff = differences(mine, hello.fingerprint)
                if diff:
                    reason = (f"node {hello.rank} ({addr[0]}) differs from node 0: "
                              + "; ".join(diff))
                    wire.send(sock, Refused(reason))
                    sock.close()
                    raise SliceStartError(reason)
                if hello.rank in peers:
                    wire.send(sock, Refused(f"node {hello.rank} joined twice"))
                    sock.close()
                    raise SliceStartError(f"node {hello.rank} joined twice "
                                          f"({peers[hello.rank].address} and {addr[0]})")
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[hello.rank] = _Peer(hello.rank, sock, addr[0], time.monotonic())
            for peer in peers.values():
                wire.send(peer.sock, Welcome())
        except BaseException:
            for peer in peers.values():
                peer.sock.close()
            raise
        finally:
            server.close()
        return cls(cfg, [peers[r] for r in sorted(peers)])

    # ---- serving -------------------------------------------------------------------
    def start_watch(self, on_lost: Callable[[str], None] | None = None) -> None:
        """Readers (acks, heartbeats) and the watchdog; `on_lost(reason)` runs once, on
        the watchdog's thread, when a follower is lost."""
        if on_lost is not None:
            self._on_lost.append(on_lost)
        now = time.monotonic()
        for peer in self._peers:
            peer.last_heard = now
            reader = threading.Thread(target=self._read, args=(peer,), daemon=True,
                                      name=f"multihost-read-{peer.rank}")
            self._readers[peer.rank] = reader
            reader.start()
        threading.Thread(target=self._watch, daemon=True, name="multihost-watch").start()

    def add_on_lost(self, callback: Callable[[str], None]) -> None:
        self._on_lost.append(callback)

    def send(self, body: Any) -> int:
        """Send `body` to every follower, in order; its size in bytes (one copy)."""
        with self._lock:
            if self.lost is not None:
                raise FollowerLost(self.lost)
            self._seq += 1
            data = wire.encode(Sequenced(self._seq, body))
            now = time.monotonic()
            for peer in self._peers:
                peer.unacked_since[self._seq] = now
                try:
                    peer.sock.sendall(data)
                except OSError as e:
                    self._declare(f"node {peer.rank} ({peer.address}): the step stream "
                                  f"broke ({e})")
                    raise FollowerLost(self.lost) from e
            self._last_sent = now
            self.bytes_sent += len(data)
            return len(data)

    def _read(self, peer: _Peer) -> None:
        try:
            while True:
                msg = wire.receive(peer.sock)
                peer.last_heard = time.monotonic()
                if isinstance(msg, Ack):
                    peer.acked = max(peer.acked, msg.seq)
                    for seq in [s for s in list(peer.unacked_since) if s <= msg.seq]:
                        peer.unacked_since.pop(seq, None)
        except (OSError, ConnectionError, EOFError) as e:
            if not self._closed:
                self._declare(f"node {peer.rank} ({peer.address}) closed the step stream "
                              f"({type(e).__name__}: {e}): the process died or exited")

    def _watch(self) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        while not self._closed and self.lost is None:
            time.sleep(WATCH_TICK_S)
            now = time.monotonic()
            for peer in self._peers:
                pending = list(peer.unacked_since.values())
                if now - peer.last_heard > timeout:
                    self._declare(f"node {peer.rank} ({peer.address}) sent nothing for "
                                  f"{now - peer.last_heard:.1f} s (heartbeat timeout "
                                  f"{timeout:.0f} s): dead or stopped")
                elif pending and now - min(pending) > timeout:
                    self._declare(f"node {peer.rank} ({peer.address}) has not run operation "
                                  f"{peer.acked + 1} for {now - min(pending):.1f} s: hung")
            # never wait for the lock: a sender blocked on a stopped follower's full socket
            # holds it, and this thread must still declare that follower lost
            if (now - self._last_sent > timeout / 4 and self.lost is None
                    and self._lock.acquire(blocking=False)):
                try:
                    for peer in self._peers:
                        try:
                            peer.sock.sendall(wire.encode(Beat()))
                        except OSError:
                            pass  # its reader reports the broken stream
                    self._last_sent = now
                finally:
                    self._lock.release()

    def _declare(self, reason: str) -> None:
        if self.lost is not None or self._closed:
            return
        self.lost = reason
        for callback in self._on_lost:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - every callback runs
                pass

    def close(self) -> None:
        """Tell every follower to exit, wait (at most CLOSE_WAIT_S) until each has closed
        its end, then close (idempotent). The leader's process hosts JAX's coordination
        service: a follower still running when it goes is aborted by its JAX client
        (SIGABRT), so the leader outlives its followers."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            for peer in self._peers:
                try:
                    peer.sock.sendall(wire.encode(Close()))
                    peer.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        deadline = time.monotonic() + CLOSE_WAIT_S
        for peer in self._peers:
            reader = self._readers.get(peer.rank)
            if reader is not None:  # it returns at the follower's end of stream
                reader.join(max(0.0, deadline - time.monotonic()))
            else:
                _drain_until_closed(peer.sock, deadline)
            peer.sock.close()


class FollowerLink:
    def __init__(self, cfg: MultiHostConfig, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self._lock = threading.Lock()
        self.last_heard = time.monotonic()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @classmethod
    def join(cls, cfg: MultiHostConfig, mine: dict[str, str]) -> FollowerLink:
        """Connect to the leader (retrying until the start-up timeout) and say hello."""
        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            try:
                sock = socket.create_connection((cfg.host, cfg.stream_port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise SliceStartError(
                        f"node 0 (the leader) never listened at {cfg.host}:{cfg.stream_port}"
                        f" within {cfg.startup_timeout_s:.0f} s ({e})") from None
                time.sleep(0.2)
        sock.settimeout(cfg.startup_timeout_s)
        wire.send(sock, Hello(cfg.node_rank, mine))
        try:
            answer = wire.receive(sock)
        except (OSError, ConnectionError) as e:
            raise SliceStartError(f"node 0 closed the step stream at start-up ({e}): "
                                  "another host may have been refused") from None
        if isinstance(answer, Refused):
            raise SliceStartError(f"refused by node 0: {answer.reason}")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(cfg, sock)

    def receive(self) -> Any:
        """The leader's next message (heartbeats skipped); ConnectionError once the stream
        is closed. Read by `start_watch`'s reader thread, so the leader is heard while this
        host compiles or runs."""
        msg = self._inbox.get()
        if isinstance(msg, BaseException):
            raise ConnectionError(str(msg))
        return msg

    def ack(self, seq: int) -> None:
        with self._lock:
            self.sock.sendall(wire.encode(Ack(seq)))

    def start_watch(self, on_lost: Callable[[str], None]) -> None:
        """The reader, heartbeats to the leader, and `on_lost(reason)` once if the leader
        goes silent."""
        def read() -> None:
            try:
                while True:
                    msg = wire.receive(self.sock)
                    self.last_heard = time.monotonic()
                    if not isinstance(msg, Beat):
                        self._inbox.put(msg)
            except (OSError, ConnectionError, EOFError) as e:
                self._inbox.put(ConnectionError(f"the step stream closed ({e})"))

        def watch() -> None:
            timeout = self.cfg.heartbeat_timeout_s
            while True:
                time.sleep(min(WATCH_TICK_S, timeout / 4))
                silent = time.monotonic() - self.last_heard
                if silent > timeout:
                    on_lost(f"node 0 (the leader) sent nothing for {silent:.1f} s")
                    return
                try:
                    with self._lock:
                        self.sock.sendall(wire.encode(Beat()))
                except OSError:
                    return  # the reader reports the closed stream
        threading.Thread(target=read, daemon=True, name="multihost-read").start()
        threading.Thread(target=watch, daemon=True, name="multihost-watch").start()
