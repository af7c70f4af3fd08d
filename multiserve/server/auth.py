"""API-key protection of an HTTP app, and the start-up warning for exposed binds.

Owns: `ApiKeyMiddleware` (pure ASGI: every HTTP request must carry
`Authorization: Bearer <key>`, OpenAI-style, else 401 with an OpenAI error body),
`protect(app, api_key)` to install it, `is_loopback(host)` and `exposure_warning(host,
api_key)`, the text logged when a server binds a non-loopback address without a key.

Invariants:
- With a key set, no route is reachable without it: the middleware wraps the whole
  app (engine and supervisor alike, control and weight endpoints included), and
  unknown paths answer 401, not 404, so the route table is not disclosed either.
- The comparison is constant-time (`hmac.compare_digest`); the key is never logged
  nor echoed in a response.
- Nothing here imports jax.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from typing import Any

from multiserve.config import API_KEY_ENV

log = logging.getLogger("multiserve.server")

Scope = dict[str, Any]


def _unauthorized(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = json.dumps({"error": {"message": message, "type": "AuthenticationError",
                                 "param": None, "code": "invalid_api_key"}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"www-authenticate", b'Bearer realm="multiserve"')]
    return body, headers


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header, if any."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """Refuses every HTTP request whose bearer token is not `api_key` (401)."""

    def __init__(self, app: Any, api_key: str) -> None:
        assert api_key, "an empty API key would protect nothing"
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is not None and hmac.compare_digest(token.encode(), self._key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "invalid API key")
        body, headers = _unauthorized(message)
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def protect(app: Any, api_key: str | None) -> None:
    """Require `api_key` on every request to `app` (a FastAPI/Starlette app); None: open."""
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on this machine
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server on `host` without a key, or None when there is no risk."""
    if api_key or is_loopback(host):
        return None
    return (f"WARNING: binding {host}, which is not a loopback address, WITHOUT an API key: "
            f"anyone who can reach this host can generate, pause, flush, abort and replace "
            f"the weights. Set --api-key (or ${API_KEY_ENV}) or bind 127.0.0.1.")


def warn_if_exposed(host: str, api_key: str | None) -> str | None:
    """Log `exposure_warning` (at WARNING) and return it."""
    text = exposure_warning(host, api_key)
    if text is not None:
        log.warning(text)
    return text
