"""The request bodies the supervisor's own routes parse (strict: unknown keys and wrong
types are a 400 naming the field). The RL routes' bodies are the engines' own
(server/rl_routes.py). Imported by the handlers (supervisor.py) and the OpenAPI
document (supervisor_openapi.py) alike, so both describe the same models.

Invariant: the pause and abort bodies ARE the engine's (server/protocol_native.py):
their fields, types and defaults are defined there only; here they differ in nothing
but refusing unknown keys (the engine ignores them, as sglang does).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from multiserve.server import protocol_native as N

_STRICT = ConfigDict(extra="forbid", strict=True)


class _Body(BaseModel):
    model_config = _STRICT


class PauseBody(N.PauseBody):
    model_config = _STRICT


class EmptyBody(_Body):
    pass


class AbortBody(N.AbortBody):
    model_config = _STRICT


class RestartBody(_Body):
    engine: int
