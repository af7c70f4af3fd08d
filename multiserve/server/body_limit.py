"""The request-body bound of an HTTP app: a body over `max_request_bytes` is refused with
413 and an OpenAI error body stating the limit, before anything parses it.

Owns `BodyLimitMiddleware` (pure ASGI) and `limit_body(app, max_bytes)` to install it.

Invariants:
- No handler sees a body over the limit: a declared `Content-Length` over it is refused
  before a byte is read; otherwise the body is read here, counting, and refused as soon
  as the count passes the limit (a chunked body without a length is bounded too).
- A body within the limit reaches the app whole and unchanged (replayed as one message);
  later `receive()` calls go to the server, so a handler still sees a disconnect.
- Nothing here imports jax.
"""

from __future__ import annotations

import json
from typing import Any

from multiserve.server.errors import ApiError

Scope = dict[str, Any]
Message = dict[str, Any]


def too_large_body(max_bytes: int) -> dict[str, Any]:
    """The OpenAI error body of a 413."""
    return ApiError(413, f"request body is larger than this server's limit of {max_bytes} "
                    f"bytes (max_request_bytes; `multiserve serve --max-request-bytes`)",
                    code="request_too_large").body()


class BodyLimitMiddleware:
    """Refuses (413) every HTTP request whose body is over `max_bytes`."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        assert max_bytes > 0
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(too_large_body(self.max_bytes)).encode()
        # "connection: close": the rest of the body is not read, so the connection ends
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself
    return None


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that returns the whole body once, then defers to the server's."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def limit_body(app: Any, max_bytes: int) -> None:
    """Refuse bodies over `max_bytes` on every route of `app` (a FastAPI/Starlette app)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
