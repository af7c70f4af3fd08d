"""The request bodies the supervisor's own routes parse (strict: unknown keys and wrong
types are a 400 naming the field). The RL routes' bodies are the engines' own
(server/rl_routes.py). Imported by the handlers (supervisor.py) and the OpenAPI
document (supervisor_openapi.py) alike, so both describe the same models.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from multiserve.types import PauseMode


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PauseBody(_Body):
    mode: PauseMode = "abort"


class EmptyBody(_Body):
    pass


class AbortBody(_Body):
    rid: str | None = None
    abort_all: bool = False


class RestartBody(_Body):
    engine: int
