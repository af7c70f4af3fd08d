"""The control routes of one engine's app, derived from the table of operations.

Owns `add_control_routes(app, engine, group)`: for every operation of
multiserve/control_ops.py in `group` that has a route, one route at its path and methods
that parses the operation's body (server/control_bodies.py), runs
`engine.acontrol(name, **args)` and answers the `ControlResult` as JSON (`success`,
`message`, details). `build_app` adds the core group (pause, continue, abort, flush);
`add_rl_routes(app, engine)` the RL group (memory release/resume, weight updates).

Answers: 200 when the operation succeeded; when it did not, the row's `refused_status`
(400 with the OpenAI error object, or 200 where sglang answers the outcome in the body
only); 400 for an invalid body or argument (naming it); 503 when the engine is
unavailable.

Invariants: jax-free (talks to the engine only through `EngineClient.acontrol`); the app
keeps no state of its own; adding an operation to the table adds its route here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.control_ops import OPS, ControlOp, Group
from multiserve.server.control_bodies import ControlBody, body_for
from multiserve.server.errors import ApiError, bad_request, with_error
from multiserve.server.http_utils import parse_body
from multiserve.types import ControlResult, EngineClient, EngineUnavailable


def routed_ops(group: Group) -> list[ControlOp]:
    """The operations of `group` that have a route, in table order."""
    return [op for op in OPS.values() if op.group == group and op.route is not None]


async def read_body(model: type[ControlBody] | None, request: Request, *,
                    allow_empty: bool | None = None) -> ControlBody | None:
    """The body of a control request (None: the route reads none); a GET with a body model
    reads the query string. `allow_empty` defaults to the model's `optional_body`."""
    if model is None:
        return None
    if request.method == "GET":
        return model.from_query(request.query_params)  # empty unless it reads_query
    empty_ok = model.optional_body if allow_empty is None else allow_empty
    return parse_body(model, await request.body(), allow_empty=empty_ok)


async def run_op(engine: EngineClient, op: ControlOp, body: ControlBody | None
                 ) -> ControlResult:
    """The operation's answer for one engine: the body's own (nothing to do), or the
    engine's, as the body presents it. Raises what the engine raises."""
    if body is None:
        return await engine.acontrol(op.name)
    ready = body.ready_answer()
    if ready is not None:
        return ready
    return body.answer(op.name, await engine.acontrol(op.name, **body.op_args()))


def control_response(result: ControlResult, refused_status: int = 400) -> Response:
    """The answer's JSON; a refusal's status is its own `http_status` detail where it
    gives one (LoRA: 404 unknown adapter, 409 slots full / adapter in use), else the
    operation's `refused_status`."""
    status = 200 if result.ok else int(result.details.get("http_status", refused_status))
    return JSONResponse(with_error(result.to_dict(), status), status_code=status)


def _route(engine: EngineClient, op: ControlOp) -> Callable[[Request], Awaitable[Response]]:
    model = body_for(op)

    async def route(request: Request) -> Response:
        body = await read_body(model, request)
        try:
            result = await run_op(engine, op, body)
        except EngineUnavailable as e:
            raise ApiError(503, f"engine unavailable: {e}", code="engine_unavailable") from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        return control_response(result, op.refused_status)

    return route


def add_control_routes(app: FastAPI, engine: Any, group: Group) -> None:
    """Add the routes of `group`'s operations to `app` (one engine's app), calling
    `engine` (an EngineClient)."""
    for op in routed_ops(group):
        assert op.route is not None
        for path in op.route.paths:
            app.add_api_route(path, _route(engine, op), methods=list(op.route.methods),
                              name=op.name)


def add_rl_routes(app: FastAPI, engine: Any) -> None:
    """Add the RL control routes (memory release/resume, weight updates) to an app built by
    `build_app`."""
    add_control_routes(app, engine, "rl")
