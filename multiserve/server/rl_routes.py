"""RL control endpoints of one engine's HTTP app: memory release/resume and weight updates.

Owns `add_rl_routes(app, engine)`, which adds to an app built by `build_app`:
  POST /release_memory_occupation  {"tags"?: [...], "mode"?: "retract", "preserve_state"?}
  POST /resume_memory_occupation   {"tags"?: [...]}
  POST /update_weights_from_disk   {"model_path" | "path", "weight_version",
                                    "abort_running"?}
  POST /stage_weights_from_disk    {"model_path" | "path", "weight_version",
                                    "abort_running"?}  -> {"token", ...}
  POST /publish_staged_weights     {"token", "abort_running"?}
  POST /discard_staged_weights     {"token"?}
  GET|POST /get_weights_by_name    {"name", "truncate_size"?: 100} (GET: query params)
Answers: the engine's ControlResult as JSON (`success`, `message`, details), 200 when it
succeeded, 400 when it was refused or invalid (the message says why and names the
tensor), 503 when the engine is unavailable.

Invariants: jax-free (talks to the engine only through its `async_*` methods); the app
keeps no state of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.server.errors import ApiError, bad_request, with_error
from multiserve.server.http_utils import parse_body
from multiserve.types import ControlResult, EngineUnavailable

RL_METHODS = ("async_release_memory_occupation", "async_resume_memory_occupation",
              "async_update_weights_from_disk", "async_stage_weights_from_disk",
              "async_publish_staged_weights", "async_discard_staged_weights",
              "async_get_weights_by_name")


def rl_target(client: Any) -> Any:
    """The object that implements the RL methods for `client`: the client itself (an
    Engine, or a handle that forwards them), else the Engine inside a fleet worker
    (its public `engine` attribute)."""
    if all(hasattr(client, m) for m in RL_METHODS):
        return client
    engine = getattr(client, "engine", None)
    if engine is None:
        ok, reason = client.health() if hasattr(client, "health") else (False, "no engine")
        raise EngineUnavailable(reason if not ok else "this engine has no RL control API")
    return engine


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ReleaseBody(_Body):
    tags: list[str] | None = None
    mode: Literal["abort", "retract", "in_place"] = "retract"
    preserve_state: bool = False


class ResumeBody(_Body):
    tags: list[str] | None = None


class DiskBody(_Body):
    model_path: str | None = None
    path: str | None = None
    weight_version: str
    abort_running: bool = False

    def dir(self) -> str:
        if (self.model_path is None) == (self.path is None):
            raise bad_request("give exactly one of 'path' or 'model_path'", param="path")
        return self.model_path if self.model_path is not None else self.path  # type: ignore


class TokenBody(_Body):
    token: str
    abort_running: bool = False


class DiscardBody(_Body):
    token: str | None = None


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int = 100


def control_response(result: ControlResult) -> Response:
    status = 200 if result.ok else 400
    return JSONResponse(with_error(result.to_dict(), status), status_code=status)


async def run_control(call: Callable[[], Awaitable[ControlResult]]) -> Response:
    try:
        result = await call()
    except EngineUnavailable as e:
        raise ApiError(503, f"engine unavailable: {e}", code="engine_unavailable") from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    return control_response(result)


def add_rl_routes(app: FastAPI, engine: Any) -> None:
    """Add the RL endpoints above to `app` (one engine's app), calling `engine`."""

    def eng() -> Any:
        return rl_target(engine)

    async def release(request: Request) -> Response:
        b = parse_body(ReleaseBody, await request.body(), allow_empty=True)
        tags = tuple(b.tags) if b.tags else None
        return await run_control(lambda: eng().async_release_memory_occupation(
            tags, b.mode, b.preserve_state))

    async def resume(request: Request) -> Response:
        b = parse_body(ResumeBody, await request.body(), allow_empty=True)
        tags = tuple(b.tags) if b.tags else None
        return await run_control(lambda: eng().async_resume_memory_occupation(tags))

    async def update_from_disk(request: Request) -> Response:
        b = parse_body(DiskBody, await request.body())
        path = b.dir()
        return await run_control(lambda: eng().async_update_weights_from_disk(
            path, b.weight_version, b.abort_running))

    async def stage_from_disk(request: Request) -> Response:
        b = parse_body(DiskBody, await request.body())
        path = b.dir()
        return await run_control(lambda: eng().async_stage_weights_from_disk(
            path, b.weight_version, b.abort_running))

    async def publish(request: Request) -> Response:
        b = parse_body(TokenBody, await request.body())
        return await run_control(lambda: eng().async_publish_staged_weights(
            b.token, b.abort_running))

    async def discard(request: Request) -> Response:
        b = parse_body(DiscardBody, await request.body(), allow_empty=True)
        return await run_control(lambda: eng().async_discard_staged_weights(b.token))

    async def weights_by_name(request: Request) -> Response:
        if request.method == "GET":
            q = request.query_params
            if "name" not in q:
                raise bad_request("name: required", param="name")
            try:
                b = WeightsByNameBody(name=q["name"],
                                      truncate_size=int(q.get("truncate_size", 100)))
            except ValueError:
                raise bad_request("truncate_size: must be an integer",
                                  param="truncate_size") from None
        else:
            b = parse_body(WeightsByNameBody, await request.body())
        return await run_control(lambda: eng().async_get_weights_by_name(
            b.name, b.truncate_size))

    routes: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
        ("/release_memory_occupation", release, ["POST"]),
        ("/resume_memory_occupation", resume, ["POST"]),
        ("/update_weights_from_disk", update_from_disk, ["POST"]),
        ("/stage_weights_from_disk", stage_from_disk, ["POST"]),
        ("/publish_staged_weights", publish, ["POST"]),
        ("/discard_staged_weights", discard, ["POST"]),
        ("/get_weights_by_name", weights_by_name, ["GET", "POST"]),
    ]
    for path, fn, methods in routes:
        app.add_api_route(path, fn, methods=methods, name=path.strip("/"))
