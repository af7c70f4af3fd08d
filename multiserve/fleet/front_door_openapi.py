"""The OpenAPI description of the fleet's front door (fleet/front_door.py).

Owns `document_front_door(model_name, vocab_size)`: the engine app's entries for the routes
the front door forwards (the same bodies and answers: it relays them unchanged; a request
that finds no engine taking work gets the engines' 503), plus its own routes.

Invariant: documentation only; the forwarded routes' models are the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from multiserve.server.api_schema import document_engine_app
from multiserve.server.openapi_docs import Answer


class FrontDoorHealth(BaseModel):
    model_config = ConfigDict(extra="allow")
    healthy: bool
    engines: list[dict[str, Any]]


class RoutingStats(BaseModel):
    model_config = ConfigDict(extra="allow")
    routed: list[int]
    by_reason: dict[str, int]
    sessions: int
    in_flight: list[int]


class FinishedSession(BaseModel):
    model_config = ConfigDict(extra="allow")
    success: bool
    session_id: str
    released: bool


ANSWERS = {
    ("GET", "/health"): Answer(FrontDoorHealth, errors=("401", "503")),
    ("GET", "/routing_stats"): Answer(RoutingStats, errors=("401",)),
    ("POST", "/finish_session"): Answer(FinishedSession, errors=("400", "401")),
}
QUERY = {("POST", "/finish_session"): [
    {"name": "session_id", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "the session to forget (else the body's session_id)"}]}


def document_front_door(model_name: str, vocab_size: int) -> Callable[[FastAPI], None]:
    def document(app: FastAPI) -> None:
        document_engine_app(app, model_name, vocab_size, answers=ANSWERS, query=QUERY)
    return document
