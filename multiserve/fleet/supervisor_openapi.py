"""The OpenAPI description of the supervisor app: every route's body and answers.

Owns `document_supervisor_app(app)` (see server/openapi_docs.py), covering the routes of
`build_supervisor_app` and of `add_rl_supervisor_routes` (documented once present).

Invariant: documentation only; the models are the ones the handlers parse.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from multiserve.control_ops import OPS
from multiserve.fleet import supervisor_bodies as S
from multiserve.server import weight_transfer as WT
from multiserve.server.api_schema import (
    ENGINE_STATE_SCHEMA,
    PROCESS_MEMORY_SCHEMA,
    WT_ANSWERS,
)
from multiserve.server.control_bodies import body_for, query_parameters
from multiserve.server.openapi_docs import Answer, Key, document
from multiserve.server.vllm_pause import PAUSE_PARAMETERS


class FleetAnswer(BaseModel):
    """A broadcast's aggregate: success only if every engine succeeded, per engine detail."""

    model_config = ConfigDict(extra="allow")
    success: bool
    message: str
    engines: list[dict[str, Any]] = []


# GET /get_server_info: every engine's state (null where it could not be read: then 503)
FLEET_INFO_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["num_engines", "enable_memory_saver", "max_request_bytes",
                                   "engines", "internal_states", "memory"],
    "properties": {
        "memory": {"type": "object", "description": "the process's resident memory, and "
                   "the sums over the engines that answered of what each holds",
                   "properties": {"process": PROCESS_MEMORY_SCHEMA,
                                  "engines_total": {"type": "object"}},
                   "required": ["process", "engines_total"]},
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


class FleetPaused(BaseModel):
    """vLLM's /is_paused for the fleet: true iff every engine is paused."""

    model_config = ConfigDict(extra="allow")
    is_paused: bool
    engines: list[dict[str, Any]]


LORA_OPS = ("load_lora_adapter", "unload_lora_adapter")
# every operation the supervisor offers (a row of control_ops.OPS with a `fleet` merge)
FLEET_OPS = [op for op in OPS.values() if op.fleet is not None and op.route is not None]
BODIES: dict[Key, Any] = {
    **{(m, op.route.path): S.fleet_body_for(op) for op in FLEET_OPS if op.route is not None
       for m in op.route.methods if m != "GET"},
    ("POST", "/restart_engine"): S.RestartBody,
    # LoRA, all engines or none (supervisor_lora.py): the engine's bodies
    **{("POST", path): body_for(OPS[name]) for name in LORA_OPS
       for path in OPS[name].route.paths},  # type: ignore[union-attr]
}
OPTIONAL = frozenset(k for k, m in BODIES.items() if m.optional_body) | WT.OPTIONAL
BODIES.update(WT.BODIES)  # the weight-transfer set-up answers the same everywhere
# a GET spelling reads the query string where its body says so (get_weights_by_name)
QUERY: dict[Key, list[dict[str, Any]]] = {
    ("GET", op.route.path): query_parameters(S.fleet_body_for(op))
    for op in FLEET_OPS if op.route is not None and "GET" in op.route.methods
    and S.fleet_body_for(op).reads_query}
FLEET_ERRORS = ("400", "401", "503")
ANSWERS: dict[Key, Answer] = {
    **{(m, op.route.path): Answer(FleetAnswer, errors=FLEET_ERRORS) for op in FLEET_OPS
       if op.route is not None for m in op.route.methods},
    ("POST", "/restart_engine"): Answer(FleetAnswer, errors=("400", "401", "409", "503")),
    **{("POST", path): Answer(FleetAnswer, errors=("400", "401", "404", "409", "503", "504"))
       for name in LORA_OPS for path in OPS[name].route.paths},  # type: ignore[union-attr]
    ("GET", "/health"): Answer(errors=("401", "503")),
    ("GET", "/get_server_info"): Answer(FLEET_INFO_SCHEMA, errors=("401", "503")),
    ("GET", "/get_weight_version"): Answer(FleetWeightVersion, errors=("401", "503")),
    ("GET", "/metrics"): Answer(text=True, errors=("401",)),
    ("GET", "/v1/models"): Answer(errors=("401",)),
    **WT_ANSWERS,
    # vLLM's pause routes on every engine (supervisor_vllm.py)
    ("POST", "/pause"): Answer(FleetAnswer, errors=("400", "401", "500", "503", "504")),
    ("POST", "/resume"): Answer(FleetAnswer, errors=("400", "401", "500", "503", "504")),
    ("GET", "/is_paused"): Answer(FleetPaused, errors=("401", "503")),
}
QUERY[("POST", "/pause")] = PAUSE_PARAMETERS


def document_supervisor_app(app: FastAPI) -> None:
    document(app, BODIES, ANSWERS, optional_bodies=OPTIONAL, query=QUERY)
