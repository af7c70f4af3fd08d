"""The request bodies the supervisor's own routes parse (strict: unknown keys and wrong
types are a 400 naming the field). Imported by the handlers (supervisor.py) and the OpenAPI
document (supervisor_openapi.py) alike, so both describe the same models.

Invariant: a broadcast route's body IS the engine's (server/control_bodies.py): the
fields, types and defaults are defined there only; the pause and abort bodies here differ
in nothing but refusing unknown keys (the engine ignores them, as sglang does) and, for
abort, asking for exactly one of rid and abort_all; continue and flush take an empty
object (the engine's routes read no body).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict

from multiserve.control_ops import ControlOp
from multiserve.server import control_bodies as C
from multiserve.server.errors import bad_request

_STRICT = ConfigDict(extra="forbid", strict=True)


class EmptyBody(C.ControlBody):
    optional_body: ClassVar[bool] = True


class PauseBody(C.PauseBody):
    model_config = _STRICT


class AbortBody(C.AbortBody):
    model_config = _STRICT

    def op_args(self) -> dict[str, Any]:
        rid = self.rid or None
        if (rid is None) == (not self.abort_all):
            raise bad_request("give exactly one of rid or abort_all=true", "rid")
        return {"rid": rid, "abort_all": self.abort_all}


class RestartBody(C.ControlBody):
    engine: int


# the supervisor's spelling of a broadcast operation's body, where it is not the engine's
FLEET_BODIES: dict[str, type[C.ControlBody]] = {
    "pause_generation": PauseBody,
    "continue_generation": EmptyBody,
    "flush_cache": EmptyBody,
    "abort_request": AbortBody,
}


def fleet_body_for(op: ControlOp) -> type[C.ControlBody]:
    return FLEET_BODIES.get(op.name) or C.body_for(op) or EmptyBody
