"""Honest OpenAPI documents for apps whose handlers parse their own bodies.

The endpoints read `request.body()` and validate it with strict pydantic models (so
errors keep the OpenAI shape), which leaves FastAPI's generated schema without request
bodies. `document(app, bodies, answers)` makes `app.openapi()` declare, per documented
(method, path): the JSON request body (the very model the handler parses, its `$defs`
hoisted into components), the success answer, and the error answers with the OpenAI
error body. A schema fuzzer then reaches the real validation instead of guessing.

Owns: the error-body and control-answer schemas and the patching of `app.openapi`.

Invariants: documentation only: nothing here changes how a request is handled; a
route without an entry keeps FastAPI's own description; the document is built once,
lazily, after every route was added (so routes added after `build_app` count too).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

Key = tuple[str, str]  # (METHOD, path)
JSON = "application/json"
SSE = "text/event-stream"

ERROR_STATUSES = {"400": "invalid request (the message names the parameter)",
                  "401": "missing or wrong API key (when the server has one)",
                  "404": "unknown model, route or LoRA adapter",
                  "409": "conflict: every LoRA slot is taken, the adapter is loaded, or "
                         "live requests use it",
                  "413": "request body over the server's max_request_bytes",
                  "429": "waiting queue full (Retry-After says when to retry)",
                  "503": "engine unavailable, asleep, paused or overloaded (reason given)"}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: an OpenAI-style error object (control answers add their
    `success`/`message` details beside it)."""

    model_config = ConfigDict(extra="allow")
    error: ErrorDetail


class ControlAnswer(BaseModel):
    """A control call's outcome: `success`, `message`, and call-specific details."""

    model_config = ConfigDict(extra="allow")
    success: bool
    message: str


class Answer:
    """How one route answers: its 200 body (a model, a list of them, a raw JSON schema or
    plain text) and, if it may stream SSE instead, the model of one event's JSON data
    (`stream`: a chunk, which for chat differs from the whole answer)."""

    def __init__(self, ok: type[BaseModel] | dict[str, Any] | None = None, *,
                 stream: type[BaseModel] | dict[str, Any] | None = None,
                 one_or_list: bool = False, text: bool = False,
                 errors: tuple[str, ...] = ("400", "401", "503")) -> None:
        self.ok, self.stream, self.one_or_list, self.text = ok, stream, one_or_list, text
        self.errors = errors


def sse_event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One event of an SSE answer. OpenAPI before 3.2 (FastAPI writes 3.1) reads the
    `schema` of text/event-stream as one event's: an object whose `data` is the final
    `[DONE]`, or JSON text holding a chunk or, when the request failed after the headers
    were sent, an error object (http_utils.sse_error)."""
    data = {"type": "string", "contentMediaType": JSON,
            "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}}}


def _schema(model: type[BaseModel] | dict[str, Any], components: dict[str, Any]) -> dict:
    """`model`'s JSON schema with its `$defs` moved into `components`; a $ref to it."""
    if isinstance(model, dict):
        return model
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _responses(answer: Answer, components: dict[str, Any]) -> dict[str, Any]:
    if answer.text:
        content: dict[str, Any] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        ok = _schema(answer.ok, components) if answer.ok is not None else {"type": "object"}
        if answer.one_or_list:
            ok = {"anyOf": [ok, {"type": "array", "items": ok}]}
        content = {JSON: {"schema": ok}}
    err = _schema(ErrorBody, components)
    if answer.stream is not None:
        content[SSE] = {"schema": sse_event_schema(_schema(answer.stream, components), err)}
    out: dict[str, Any] = {"200": {"description": "success", "content": content}}
    for status in answer.errors:
        out[status] = {"description": ERROR_STATUSES.get(status, "error"),
                       "content": {JSON: {"schema": err}}}
    return out


def document(app: FastAPI, bodies: Mapping[Key, type[BaseModel]],
             answers: Mapping[Key, Answer], *, optional_bodies: frozenset[Key] = frozenset(),
             query: Mapping[Key, list[dict[str, Any]]] | None = None,
             patch_components: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Make `app.openapi()` declare `bodies`, `answers` and `query` parameters (see the
    module docstring); `patch_components(schemas)` may refine the component schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():  # a GET+POST route repeats its operation id:
            warnings.filterwarnings("ignore", "Duplicate Operation ID")  # unique ones below
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components: dict[str, Any] = doc.setdefault("components", {}).setdefault(
            "schemas", {})
        for path, item in doc.get("paths", {}).items():
            for method, op in item.items():
                key = (method.upper(), path)
                op["operationId"] = f"{method}{path}".replace("/", "_")
                if key in bodies:
                    op["requestBody"] = {"required": key not in optional_bodies,
                                         "content": {JSON: {"schema": _schema(
                                             bodies[key], components)}}}
                if key in answers:
                    op["responses"] = _responses(answers[key], components)
                if key in bodies:  # every app bounds its bodies (server/body_limit.py)
                    op.setdefault("responses", {})["413"] = {
                        "description": ERROR_STATUSES["413"],
                        "content": {JSON: {"schema": _schema(ErrorBody, components)}}}
                if query and key in query:
                    op["parameters"] = query[key]
        if patch_components is not None:
            patch_components(components)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
