"""The OpenAPI description of the supervisor app: every route's body and answers.

Owns `document_supervisor_app(app)` (see server/openapi_docs.py), covering the routes of
`build_supervisor_app` and of `add_rl_supervisor_routes` (documented once present).

Invariant: documentation only; the models are the ones the handlers parse.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from multiserve.fleet import supervisor_bodies as S
from multiserve.server import rl_routes as R
from multiserve.server.api_schema import ENGINE_STATE_SCHEMA
from multiserve.server.openapi_docs import Answer, Key, document


class FleetAnswer(BaseModel):
    """A broadcast's aggregate: success only if every engine succeeded, per engine detail."""

    model_config = ConfigDict(extra="allow")
    success: bool
    message: str
    engines: list[dict[str, Any]] = []


# GET /get_server_info: every engine's state (null where it could not be read: then 503)
FLEET_INFO_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["num_engines", "enable_memory_saver", "max_request_bytes",
                                   "engines", "internal_states"],
    "properties": {
        "num_engines": {"type": "integer"},
        "enable_memory_saver": {"type": "boolean", "description": "the server option as set"},
        "max_request_bytes": {"type": "integer", "description": "larger bodies get 413"},
        "engines": {"type": "array", "items": {"type": "object"}},
        "internal_states": {"type": "array",
                            "items": {"anyOf": [ENGINE_STATE_SCHEMA, {"type": "null"}]}}}}


class FleetWeightVersion(BaseModel):
    """Every engine's weight version; `weight_version` is theirs when they all agree."""

    model_config = ConfigDict(extra="allow")
    weight_version: str | None
    agree: bool
    engines: list[dict[str, Any]]


BODIES: dict[Key, Any] = {
    ("POST", "/pause_generation"): S.PauseBody,
    ("POST", "/continue_generation"): S.EmptyBody,
    ("POST", "/flush_cache"): S.EmptyBody,
    ("POST", "/abort_request"): S.AbortBody,
    ("POST", "/restart_engine"): S.RestartBody,
    ("POST", "/release_memory_occupation"): R.ReleaseBody,
    ("POST", "/resume_memory_occupation"): R.ResumeBody,
    ("POST", "/get_weights_by_name"): R.WeightsByNameBody,
    ("POST", "/update_weights_from_disk"): R.DiskBody,
}
OPTIONAL = frozenset(k for k in BODIES if k[1] in (
    "/pause_generation", "/continue_generation", "/flush_cache",
    "/release_memory_occupation", "/resume_memory_occupation"))
FLEET_ERRORS = ("400", "401", "503")
ANSWERS: dict[Key, Answer] = {
    **{k: Answer(FleetAnswer, errors=FLEET_ERRORS) for k in BODIES},
    ("GET", "/flush_cache"): Answer(FleetAnswer, errors=FLEET_ERRORS),
    ("POST", "/restart_engine"): Answer(FleetAnswer, errors=("400", "401", "409", "503")),
    ("GET", "/health"): Answer(errors=("401", "503")),
    ("GET", "/get_server_info"): Answer(FLEET_INFO_SCHEMA, errors=("401", "503")),
    ("GET", "/get_weight_version"): Answer(FleetWeightVersion, errors=("401", "503")),
    ("GET", "/metrics"): Answer(text=True, errors=("401",)),
    ("GET", "/v1/models"): Answer(errors=("401",)),
}


def document_supervisor_app(app: FastAPI) -> None:
    document(app, BODIES, ANSWERS, optional_bodies=OPTIONAL)
