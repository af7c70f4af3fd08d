"""vLLM's pause routes (its rlhf api_router,
https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/serve/rlhf/api_router.py),
mapped onto the engine's pause_generation / continue_generation; and AReaL's two vLLM-server routes,
which call the same pause.

  POST /pause?mode=abort|wait|keep&clear_cache=true&wait_for_inflight_requests=false
      -> 200 {"status": "paused", "success", "message", ...}: the answer comes once the
      pause holds ("wait": after the requests live when it began have finished; requests
      sent meanwhile are queued, as vLLM queues them, and run after /resume). vLLM's query
      parameters and defaults: mode "abort", clear_cache true (ignored for keep),
      wait_for_inflight_requests (deprecated) true means mode "wait". Our modes retract
      and in_place are accepted too ("keep" is in_place). Unknown query keys are ignored,
      as FastAPI ignores them; the body is not read.
  POST /resume    -> 200 {"status": "resumed", ...} (continue_generation)
  GET  /is_paused -> 200 {"is_paused": bool}: paused for any reason, or a "wait" pause
      still draining (vLLM's scheduler is paused from the moment /pause arrives)
  POST /areal_pause_generation   {} -> AReaL's vLLM server: abort, clear the cache
  POST /areal_continue_generation {} -> resume; both answer {"success", "message"}

A bad query value is a 400 with the error object; a "wait" pause that did not take
effect (a /resume came first) is a 409; the engine unavailable, 503.

Invariants: jax-free (EngineClient.acontrol only); no state of its own; the supervisor's
fleet-wide spelling (fleet/supervisor_vllm.py) parses the same query (`PauseQuery`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.server.errors import ApiError, from_validation_error, with_error
from multiserve.types import (
    PAUSE_MODES,
    ControlResult,
    EngineClient,
    EngineUnavailable,
    PauseMode,
)

_TRUE, _FALSE = ("true", "1", "yes", "on", "t", "y"), ("false", "0", "no", "off", "f", "n")


def query_bool(value: str, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (true/false, 1/0, yes/no, on/off)."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ApiError(400, f"{name}: not a boolean: {value!r}", param=name)


class PauseQuery(BaseModel):
    """/pause's query parameters, vLLM's names and defaults."""

    model_config = ConfigDict(extra="ignore", strict=True)
    mode: PauseMode = "abort"
    clear_cache: bool = True
    wait_for_inflight_requests: bool = False

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> PauseQuery:
        values: dict[str, Any] = {}
        if "mode" in query:
            values["mode"] = query["mode"]
        for name in ("clear_cache", "wait_for_inflight_requests"):
            if name in query:
                values[name] = query_bool(query[name], name)
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    def op_args(self) -> dict[str, Any]:
        """pause_generation's arguments."""
        mode = "wait" if self.wait_for_inflight_requests else self.mode
        return {"mode": mode, "clear_cache": self.clear_cache}


PAUSE_PARAMETERS: list[dict[str, Any]] = [
    {"name": "mode", "in": "query", "required": False,
     "schema": {"type": "string", "enum": list(PAUSE_MODES), "default": "abort"},
     "description": "abort: end live requests now (partial outputs); wait: admission "
                    "closes, live requests finish, then paused; keep: freeze them (they "
                    "go on, bit for bit, after /resume); retract / in_place: sglang's"},
    {"name": "clear_cache", "in": "query", "required": False,
     "schema": {"type": "boolean", "default": True},
     "description": "drop the cached K/V nobody holds once paused (ignored for keep)"},
    {"name": "wait_for_inflight_requests", "in": "query", "required": False,
     "schema": {"type": "boolean", "default": False},
     "description": "deprecated in vLLM: true means mode=wait"},
]


def pause_answer(result: ControlResult) -> Response:
    """/pause's answer from pause_generation's result."""
    if result.ok:
        return JSONResponse({"status": "paused", **result.to_dict()})
    status = 409 if result.details.get("cancelled") else 400
    return JSONResponse(with_error(result.to_dict(), status, code="not_paused"),
                        status_code=status)


def resume_answer(result: ControlResult) -> Response:
    return JSONResponse({"status": "resumed", **result.to_dict()})


def is_paused(state: Mapping[str, Any]) -> bool:
    """vLLM's is_paused from an engine's internal state."""
    return bool(state.get("engine_paused") or state.get("pause_pending"))


async def _control(engine: EngineClient, name: str, **args: Any) -> Any:
    try:
        return await engine.acontrol(name, **args)
    except EngineUnavailable as e:
        raise ApiError(503, f"engine unavailable: {e}", code="engine_unavailable") from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def add_vllm_pause_routes(app: FastAPI, engine: EngineClient) -> None:
    """Add /pause, /resume, /is_paused and AReaL's two routes to one engine's app."""

    async def pause(request: Request) -> Response:
        query = PauseQuery.parse(request.query_params)
        return pause_answer(await _control(engine, "pause_generation", **query.op_args()))

    async def resume(_: Request) -> Response:
        return resume_answer(await _control(engine, "continue_generation"))

    async def paused(_: Request) -> Response:
        return JSONResponse({"is_paused": is_paused(
            await _control(engine, "get_internal_state"))})

    async def areal_pause(_: Request) -> Response:
        result = await _control(engine, "pause_generation", mode="abort", clear_cache=True)
        return areal_answer(result)

    async def areal_continue(_: Request) -> Response:
        return areal_answer(await _control(engine, "continue_generation"))

    app.add_api_route("/pause", pause, methods=["POST"], name="vllm_pause")
    app.add_api_route("/resume", resume, methods=["POST"], name="vllm_resume")
    app.add_api_route("/is_paused", paused, methods=["GET"], name="vllm_is_paused")
    app.add_api_route("/areal_pause_generation", areal_pause, methods=["POST"],
                      name="areal_pause_generation")
    app.add_api_route("/areal_continue_generation", areal_continue, methods=["POST"],
                      name="areal_continue_generation")


def areal_answer(result: ControlResult) -> Response:
    """AReaL's vLLM server answers {"success", "message"}: 200, or 400 on failure."""
    status = 200 if result.ok else 400
    return JSONResponse(with_error(result.to_dict(), status), status_code=status)
