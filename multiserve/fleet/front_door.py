"""The fleet's front door: one OpenAI- and SGLang-compatible port for every engine.

Owns `build_front_door_app(engines, urls, ...)`: a reverse proxy in front of the engine
ports (which stay). Each generation request is routed by `fleet/routing.py` (sticky by
session, else longest prefix, else least loaded) among the engines that take work now
(`accepts_work`: healthy, awake, not paused, no "wait" pause draining), and forwarded
unchanged (the same bytes, to the same path, on that engine's own port); the engine's
answer comes back as it is produced, SSE streams chunk by chunk, with the engine's status.
  POST /v1/chat/completions, /v1/completions, /generate, /inference/v1/generate, /v1/score
  GET  /v1/models, /get_model_info, /model_info   (any engine that takes work, else any
                                                  healthy one)
  GET  /health          200 while some engine is healthy; per engine: healthy, accepts
  GET  /routing_stats   requests per engine and per reason, sessions, in flight
  POST /finish_session?session_id=S   (or {"session_id": S}) forget a session's pin
       (prime-rl / SkyRL call it on their router when a trajectory ends)
Sessions are the headers `X-Session-ID` (prime-rl, verifiers, SkyRL, vllm-router),
`X-SGL-Routing-Key` (SGLang's experimental router's sticky policy) and
`X-SMG-Routing-Key` (sglang-router 0.3.2's manual policy); the first present wins. Each answer says
where it went: headers `X-Routed-Engine` and `X-Routing-Reason`.

When no engine takes work (the fleet is paused, asleep), a request waits at the door
(up to RoutingConfig.wait_s, then 503), as it would wait queued on a paused engine;
when every engine is unhealthy it gets 503 at once. A request an engine refused to
connect is routed once more among the others. Bits: the request reaches an engine's own
app unchanged, so its output is the one that port gives (determinism.md: whatever the
batch or engine).

Invariants: jax-free; routing state (fleet/routing.Router) lives in this app's event loop
only; an accepted request is counted in flight until its answer ended (or its client
left, which closes the engine's stream: the engine aborts it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from multiserve.config import DEFAULT_MAX_REQUEST_BYTES, RoutingConfig
from multiserve.fleet.routing import Router
from multiserve.server.body_limit import limit_body
from multiserve.server.errors import ApiError
from multiserve.server.http_utils import error_json
from multiserve.types import cache_namespace

ROUTED_POSTS = ("/v1/chat/completions", "/v1/completions", "/generate",
                "/inference/v1/generate", "/v1/score")
FORWARDED_GETS = ("/v1/models", "/get_model_info", "/model_info")
SESSION_HEADERS = ("x-session-id", "x-sgl-routing-key", "x-smg-routing-key")
_PASSED_HEADERS = ("content-type", "retry-after", "cache-control")
POLL_S = 0.02  # how often a waiting request looks for an engine that takes work


class RoutedEngine(Protocol):
    """What the front door reads of an engine (fleet/worker.EngineWorker)."""

    def health(self) -> tuple[bool, str]: ...

    def accepts_work(self) -> tuple[bool, str]: ...


def session_of(headers: Any) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return str(value)
    return None


def prompt_key(path: str, body: Any) -> str:
    """The routing key of a request: its cache namespace, then its prompt as sent (chat:
    the tools and messages; else the text or the token ids). Requests whose keys share a
    prefix share a cached prefix on the engine (the same path's rendering of it)."""
    if not isinstance(body, dict):
        return ""
    namespace = cache_namespace(_str(body.get("cache_salt")), _first(body.get("extra_key")))
    if path == "/v1/chat/completions":
        prompt: Any = [body.get("tools"), body.get("messages")]
    elif path == "/v1/completions":
        prompt = _first(body.get("prompt"))
    elif path == "/generate":
        prompt = _first(body.get("text")) or _first(body.get("input_ids"))
    elif path == "/inference/v1/generate":
        prompt = body.get("token_ids")
    else:
        prompt = [body.get("query"), body.get("items")]
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"),
                                                             sort_keys=True, default=str)
    return f"{path}|{namespace or ''}|{text}"


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def _first(x: Any) -> Any:
    """A batch's first prompt (the batch goes to one engine), else the value."""
    if isinstance(x, list) and x and isinstance(x[0], (list, str)):
        return x[0]
    return x


class FrontDoor:
    """The proxy's state: the router, the engines, their URLs, one HTTP client."""

    def __init__(self, engines: Sequence[RoutedEngine], urls: Callable[[], Sequence[str]],
                 routing: RoutingConfig, api_key: str | None) -> None:
        self.engines = engines
        self.urls = urls
        self.routing = routing
        self.router = Router(len(engines), routing)
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the app's own event loop
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                                             trust_env=False)
        return self._client

    def eligible(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e.accepts_work()[0]]

    async def wait_eligible(self) -> list[int]:
        deadline = time.monotonic() + self.routing.wait_s
        while True:
            ready = self.eligible()
            if ready:
                return ready
            if not any(e.health()[0] for e in self.engines):
                raise ApiError(503, "no engine of the fleet is healthy: " + "; ".join(
                    f"engine {i}: {e.health()[1]}" for i, e in enumerate(self.engines)),
                    code="engine_unavailable")
            if time.monotonic() >= deadline:
                raise ApiError(503, f"no engine took work within {self.routing.wait_s:g} "
                               "s (paused or asleep)", code="engine_paused",
                               headers={"Retry-After": "1"})
            await asyncio.sleep(POLL_S)

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None  # the engine answers the 400 for it
        key, session = prompt_key(path, body), session_of(request.headers)
        excluded: set[int] = set()
        while True:
            eligible = [i for i in await self.wait_eligible() if i not in excluded]
            if not eligible:
                raise ApiError(503, "no engine of the fleet accepted the connection",
                               code="engine_unavailable")
            decision = self.router.choose(eligible, key, session)
            try:
                upstream = await self._send(decision.engine, path, request, raw)
            except httpx.TransportError:
                self.router.done(decision.engine)
                excluded.add(decision.engine)  # not delivered: another engine may take it
                continue
            return self._relay(upstream, decision.engine, decision.reason)

    async def _send(self, engine: int, path: str, request: Request, raw: bytes
                    ) -> httpx.Response:
        url = self.urls()[engine] + path
        headers = {"content-type": request.headers.get("content-type", "application/json"),
                   **self._auth}
        req = self.client().build_request(request.method, url, content=raw, headers=headers,
                                          params=request.query_params)
        return await self.client().send(req, stream=True)

    def _relay(self, upstream: httpx.Response, engine: int, reason: str) -> Response:
        router = self.router

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                router.done(engine)

        headers = {k: v for k, v in upstream.headers.items() if k.lower() in _PASSED_HEADERS}
        headers.update({"X-Routed-Engine": str(engine), "X-Routing-Reason": reason})
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=headers)

    async def forward_get(self, request: Request, path: str) -> Response:
        ready = self.eligible() or [i for i, e in enumerate(self.engines) if e.health()[0]]
        if not ready:
            raise ApiError(503, "no engine of the fleet is healthy",
                           code="engine_unavailable")
        r = await self.client().get(self.urls()[ready[0]] + path, headers=self._auth,
                                    params=request.query_params)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    def health(self) -> tuple[int, dict[str, Any]]:
        each = []
        for i, e in enumerate(self.engines):
            healthy, reason = e.health()
            takes, why = e.accepts_work()
            each.append({"engine": i, "healthy": healthy, "accepts_work": takes,
                         "reason": reason if not healthy else why})
        ok = any(x["healthy"] for x in each)
        return (200 if ok else 503), {"healthy": ok, "engines": each}

    def stats(self) -> dict[str, Any]:
        r = self.router
        return {"routed": list(r.stats.routed), "by_reason": dict(r.stats.by_reason),
                "repinned_sessions": r.stats.repinned, "sessions": len(r.sessions),
                "pinned_sessions": list(r.pinned), "in_flight": list(r.in_flight),
                "indexed_chunks": [len(ix) for ix in r.indexes],
                "policy": {k: getattr(self.routing, k) for k in (
                    "cache_threshold", "balance_abs_threshold", "balance_rel_threshold",
                    "chunk_chars", "wait_s")}}


def build_front_door_app(engines: Sequence[RoutedEngine], urls: Callable[[], Sequence[str]],
                         *, routing: RoutingConfig | None = None, api_key: str | None = None,
                         max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                         document: Callable[[FastAPI], None] | None = None) -> FastAPI:
    """The front door's app; `urls()` are the engine servers' base URLs (read at every
    request), `api_key` what they require (sent on to them). `document(app)` adds the
    OpenAPI description (fleet/front_door_openapi.py)."""
    door = FrontDoor(engines, urls, routing or RoutingConfig(), api_key)
    app = FastAPI(title="multiserve front door", docs_url=None, redoc_url=None)
    app.state.front_door = door

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_json(exc)

    for path in ROUTED_POSTS:
        app.add_api_route(path, _poster(door, path), methods=["POST"])
    for path in FORWARDED_GETS:
        app.add_api_route(path, _getter(door, path), methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        status, body = door.health()
        return JSONResponse(body, status_code=status)

    @app.get("/routing_stats")
    async def routing_stats() -> Response:
        return JSONResponse(door.stats())

    @app.post("/finish_session")
    async def finish_session(request: Request) -> Response:
        session = request.query_params.get("session_id")
        raw = await request.body()
        if session is None and raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                raise ApiError(400, "body: not JSON", param="session_id") from None
            session = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(session, str) or not session:
            raise ApiError(400, "session_id: give it as a query parameter or in the body",
                           param="session_id")
        return JSONResponse({"success": True, "session_id": session,
                             "released": door.router.finish_session(session)})

    if document is not None:
        document(app)
    limit_body(app, max_request_bytes)
    return app


def _poster(door: FrontDoor, path: str) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        return await door.forward(request, path)
    return route


def _getter(door: FrontDoor, path: str) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        return await door.forward_get(request, path)
    return route
