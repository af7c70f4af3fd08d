"""Framing of the step stream: one message = 8-byte big-endian length + a pickle.

The peers are the hosts of one slice, started by one operator with one command line, so
a message is trusted like the command line itself: the stream port must be reachable
only inside the slice (sops/run-multi-host.md).
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct(">Q")


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: Any) -> int:
    """Send one message; returns its size on the wire (bytes)."""
    data = encode(message)
    sock.sendall(data)
    return len(data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the step stream")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return pickle.loads(_exactly(sock, n))
