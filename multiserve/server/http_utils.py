"""Small HTTP helpers shared by the endpoint modules.

Owns: strict body parsing into pydantic models (errors → `ApiError`), the health gate,
SSE framing, and JSON-safe floats. (The `model` a client names is never checked: sglang
ignores it, and RL clients send the model's path.)

Invariant: a JSON body we send never contains NaN/Infinity (strict JSON parsers, and
OpenAI clients, reject them): non-finite logprobs become -9999.0.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, StreamingResponse

from multiserve.server.errors import ApiError, bad_request, from_validation_error, overloaded
from multiserve.types import EngineClient, EngineOverloaded, EngineUnavailable, InvalidRequest

M = TypeVar("M", bound=BaseModel)
NEG_INF_LOGPROB = -9999.0


def parse_body(cls: type[M], raw: bytes, *, allow_empty: bool = False) -> M:
    if not raw.strip():
        if allow_empty:
            return cls.model_validate_json(b"{}")
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def check_health(engine: EngineClient) -> None:
    ok, reason = engine.health()
    if not ok:
        raise ApiError(503, f"engine unavailable: {reason}", code="engine_unavailable")


def finite(x: float) -> float:
    if math.isnan(x):
        return NEG_INF_LOGPROB
    if math.isinf(x):
        return NEG_INF_LOGPROB if x < 0 else 0.0
    return float(x)


def sse_data(payload: Any) -> str:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=True)
    else:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_model(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=True), status_code=status)


def api_error_from(exc: Exception, fields: Mapping[str, str] | None = None) -> ApiError:
    """The client-facing error for an exception raised while a request ran. `fields`: the
    client's name for each engine field an InvalidRequest may name (e.g. input_ids ->
    prompt for the OpenAI API); the message's leading field name follows it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return overloaded(exc)
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, f"engine unavailable: {exc}", code="engine_unavailable")
    if isinstance(exc, InvalidRequest):  # the engine's check of the request
        message, param = str(exc), exc.param
        if param and fields and param in fields:
            param = fields[param]
            if message.startswith(f"{exc.param}:"):
                message = f"{param}:{message[len(exc.param) + 1:]}"
        return bad_request(message, param=param, code=exc.code)
    if isinstance(exc, ValueError):  # the engine rejected the request itself
        param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        return bad_request(str(exc), param=param if param and " " not in param else None)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def sse_error(exc: Exception) -> str:
    """An SSE error event (sent in place of further chunks, before [DONE])."""
    return sse_data(api_error_from(exc).body())


def error_json(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)
