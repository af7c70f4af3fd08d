"""RL control endpoints of one engine's HTTP app: memory release/resume and weight updates.

Owns `add_rl_routes(app, engine)`, which adds to an app built by `build_app`:
  POST /release_memory_occupation  {"tags"?: [...], "mode"?: "retract", "preserve_state"?}
  POST /resume_memory_occupation   {"tags"?: [...]}
      tags: sglang's "weights", "kv_cache", "cuda_graph" (the last is a no-op here)
  POST /update_weights_from_disk   sglang's body: {"model_path", "weight_version"?,
                                    "abort_all_requests"?, "load_format"?, "flush_cache"?,
                                    ...} (see DiskBody); also {"path", "abort_running"}
  POST /stage_weights_from_disk    the same body  -> {"token", ...}
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

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.server.errors import ApiError, bad_request, with_error
from multiserve.server.http_utils import parse_body
from multiserve.types import MEMORY_TAGS, ControlResult, EngineUnavailable, PauseMode, RLClient


def rl_client(client: Any) -> RLClient:
    """`client` as an RLClient (types.py): an Engine or a fleet worker handle. A client
    without the RL controls answers 503 (never reached past: no `client.engine`)."""
    if not isinstance(client, RLClient):
        raise EngineUnavailable("this engine has no RL control API")
    return client


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _SglangBody(BaseModel):
    """A body sglang also accepts: keys we do not know are ignored, as sglang's own request
    structs ignore them (e.g. `rid`); keys we know are type-checked."""

    model_config = ConfigDict(extra="ignore", strict=True)


# sglang's memory tags: the engine's (types.MEMORY_TAGS) plus "cuda_graph", memory this
# backend never holds (XLA keeps no CUDA graphs): releasing or resuming it is accepted and
# reported as a no-op.
NOOP_TAGS = ("cuda_graph",)


class _TagsBody(_SglangBody):
    tags: list[str] | None = None

    @field_validator("tags")
    @classmethod
    def _known_tags(cls, tags: list[str] | None) -> list[str] | None:
        bad = [t for t in tags or () if t not in MEMORY_TAGS + NOOP_TAGS]
        if bad:
            raise ValueError(f"unknown tag {bad[0]!r}; known tags: {list(MEMORY_TAGS + NOOP_TAGS)}")
        return tags

    def split_tags(self) -> tuple[tuple[str, ...] | None, list[str]]:
        """(engine tags, no-op tags named). None = every tag (sglang's default for no
        tags); an EMPTY engine tuple means only no-op tags were named."""
        if not self.tags:
            return None, []
        return (tuple(t for t in self.tags if t in MEMORY_TAGS),
                [t for t in self.tags if t in NOOP_TAGS])


class ReleaseBody(_TagsBody):
    mode: PauseMode = "retract"  # sglang's default for a release (a pause: "abort")
    preserve_state: bool = False


class ResumeBody(_TagsBody):
    pass


def noop_tags_result(verb: str, noop: list[str]) -> ControlResult:
    return ControlResult(True, f"{verb} {noop}: nothing to do (no CUDA graphs here) (no-op)",
                         {"noop_tags": noop})


def with_noop_tags(result: ControlResult, noop: list[str]) -> ControlResult:
    if not noop:
        return result
    return ControlResult(result.ok, result.message, {**result.details, "noop_tags": noop})


LOAD_FORMATS = (None, "auto", "safetensors")  # an HF safetensors directory


class DiskBody(_SglangBody):
    """sglang's UpdateWeightFromDiskReqInput, plus our `path` / `abort_running` spellings.

    - weight_version: optional; absent, a new version string is made (`new_version`).
    - abort_all_requests (sglang) / abort_running (ours): abort live requests first.
    - flush_cache: the prefix cache is ALWAYS invalidated when weights change (its K/V was
      computed with the old weights); `false` is accepted and the answer says so.
    - load_format: only an HF safetensors directory (None, "auto", "safetensors").
    - keep_pause: an update never changes whether the engine is paused, so a paused
      engine stays paused (keep_pause=true is what happens); continue it with
      /continue_generation afterwards, as slime and AReaL do.
    - is_async, torch_empty_cache, recapture_cuda_graph, token_step: nothing to do here
      (the update is staged off the engine thread anyway; no torch, no CUDA graphs).
    - manifest (a partial tensor list) is refused: every tensor of the directory is read.
    - Unknown keys are ignored (AReaL once sent `abort_all_request`, a typo sglang ignores).
    """

    model_path: str | None = None
    path: str | None = None
    weight_version: str | None = None
    abort_running: bool = False
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True
    keep_pause: bool = False
    is_async: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None

    def dir(self) -> str:
        if (self.model_path is None) == (self.path is None):
            raise bad_request("give exactly one of 'model_path' or 'path'", param="model_path")
        if self.load_format not in LOAD_FORMATS:
            raise bad_request(f"load_format: {self.load_format!r} is not supported; an HF "
                              f"safetensors directory is read (load_format 'auto' or "
                              f"'safetensors')", param="load_format")
        if self.manifest:
            raise bad_request("manifest: not supported; every tensor of the directory is "
                              "read", param="manifest")
        return self.model_path if self.model_path is not None else self.path  # type: ignore

    @property
    def abort(self) -> bool:
        return self.abort_running or self.abort_all_requests

    def version(self) -> str:
        return self.weight_version or new_version(self.dir())

    def note(self, result: ControlResult) -> ControlResult:
        """The answer, saying when flush_cache=false could not be followed."""
        if self.flush_cache or not result.ok:
            return result
        return ControlResult(result.ok, result.message + "; the prefix cache was invalidated "
                             "anyway (flush_cache=false is not honoured: cached K/V belongs "
                             "to the old weights)", {**result.details, "flush_cache": True})


def new_version(model_path: str) -> str:
    """A fresh weight version for an update that named none (sglang keeps the old name
    then; a new one lets clients tell the weights apart): the directory's name plus a
    unique suffix."""
    name = Path(model_path.rstrip("/")).name or "weights"
    return f"{name}-{uuid.uuid4().hex[:8]}"


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


async def run_control(call: Callable[[], Awaitable[ControlResult]],
                      noop_tags: list[str] | None = None,
                      note: Callable[[ControlResult], ControlResult] | None = None) -> Response:
    try:
        result = await call()
    except EngineUnavailable as e:
        raise ApiError(503, f"engine unavailable: {e}", code="engine_unavailable") from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    result = with_noop_tags(result, noop_tags or [])
    return control_response(note(result) if note is not None else result)


def add_rl_routes(app: FastAPI, engine: Any) -> None:
    """Add the RL endpoints above to `app` (one engine's app), calling `engine`."""

    def eng() -> RLClient:
        return rl_client(engine)

    async def release(request: Request) -> Response:
        b = parse_body(ReleaseBody, await request.body(), allow_empty=True)
        tags, noop = b.split_tags()
        if tags == ():
            return control_response(noop_tags_result("release", noop))
        return await run_control(lambda: eng().async_release_memory_occupation(
            tags, b.mode, b.preserve_state), noop)

    async def resume(request: Request) -> Response:
        b = parse_body(ResumeBody, await request.body(), allow_empty=True)
        tags, noop = b.split_tags()
        if tags == ():
            return control_response(noop_tags_result("resume", noop))
        return await run_control(lambda: eng().async_resume_memory_occupation(tags), noop)

    async def update_from_disk(request: Request) -> Response:
        b = parse_body(DiskBody, await request.body())
        path, version = b.dir(), b.version()
        return await run_control(lambda: eng().async_update_weights_from_disk(
            path, version, b.abort), note=b.note)

    async def stage_from_disk(request: Request) -> Response:
        b = parse_body(DiskBody, await request.body())
        path, version = b.dir(), b.version()
        return await run_control(lambda: eng().async_stage_weights_from_disk(
            path, version, b.abort))

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
