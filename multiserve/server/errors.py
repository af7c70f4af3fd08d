"""API errors of the HTTP side and their OpenAI-shaped JSON body.

Owns: `ApiError` (status + OpenAI error fields) and the conversions from pydantic
validation errors and `SamplingParamsError` into it.

Invariant: every error a client sees has the body
`{"error": {"message", "type", "param", "code"}}` and a 4xx/5xx status that matches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from multiserve.types import EngineOverloaded, SamplingParamsError


class ApiError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}  # e.g. Retry-After on 429/503
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _default_type(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "NotFoundError"
    if status == 503:
        return "ServiceUnavailableError"
    if status == 429:
        return "RateLimitError"
    if status == 401:
        return "AuthenticationError"
    if status >= 500:
        return "InternalServerError"
    return "BadRequestError"


def with_error(body: dict[str, Any], status: int, code: str = "refused") -> dict[str, Any]:
    """A control answer (`success`, `message`, details) that failed with `status` >= 400
    gets the OpenAI `error` object too, so every 4xx/5xx body has one; the sglang-style
    fields stay as they are, except a detail string under `error`, which moves to
    `error.detail`."""
    if status < 400 or isinstance(body.get("error"), dict):
        return body
    message = str(body.get("message") or f"request failed with status {status}")
    error = ApiError(status, message, code=code).body()["error"]
    if "error" in body:  # a detail string under the same key: kept inside the object
        error["detail"] = body["error"]
    return {**body, "error": error}


def overloaded(exc: EngineOverloaded) -> ApiError:
    """The engine's admission refusal: 429/503 naming the bound, with Retry-After."""
    return ApiError(exc.status, str(exc), code=exc.reason,
                    headers={"Retry-After": str(max(1, int(exc.retry_after)))})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or "invalid_request_error")


def field_path(loc: Sequence[str | int | None]) -> str:
    """A pydantic error location as OpenAI names a parameter: list items by index in
    brackets, object keys dotted (`messages[0].role`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part is not None:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(exc: ValidationError) -> ApiError:
    """First pydantic error → 400 naming the offending field (`field_path`)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request(str(exc))
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON body: {first.get('msg')}", code="invalid_json")
    loc = field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    message = f"{loc}: {msg}{more}" if loc else f"{msg}{more}"
    return bad_request(message, param=loc or None)


def from_sampling_error(exc: SamplingParamsError, rename: dict[str, str] | None = None
                        ) -> ApiError:
    """A `SamplingParamsError` → 400 naming the client's own parameter name."""
    param = (rename or {}).get(exc.field, exc.field)
    text = str(exc)
    if text.startswith(f"{exc.field}:"):
        text = text[len(exc.field) + 1:].strip()
    return bad_request(f"{param}: {text}", param=param)
