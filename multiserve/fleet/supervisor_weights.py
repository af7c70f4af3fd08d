"""The weight-update session on every engine of the fleet (vLLM's routes), all or none.

Owns `add_weight_session_supervisor_routes(app)` for an app built by
`build_supervisor_app` (bodies: the engine routes', derived from control_ops.py's records):
  POST /start_weight_update  {"free_kv_cache"?, "abort_running"?}  opens a session on
      every engine; if any refuses, the sessions opened are aborted again.
  POST /update_weights       {"update_info": {"path": dir}}  stages the checkpoint on
      every engine concurrently; if any fails, every engine's session is aborted (no
      engine changes weights) and the answer names each failure.
  POST /finish_weight_update {"weight_version"?}  publishes on every engine under ONE
      version (made here when absent), the fleet's next version; the answer names it.
      A publish refused by an engine (its state changed since staging) leaves the
      engines on different versions: the answer lists each engine's, never a silent
      partial success.

Invariants: jax-free (`EngineClient.acontrol` only); answers come after every engine
answered; 200 only if every engine succeeded.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.control_ops import OPS
from multiserve.fleet.supervisor import Supervisor, json_response
from multiserve.server.control_bodies import body_for
from multiserve.server.control_routes import read_body
from multiserve.types import ControlResult, EngineClient

SESSION_OPS = ("start_weight_update", "update_weights", "finish_weight_update")


async def _on_all(sup: Supervisor, name: str, args: dict[str, Any]
                  ) -> tuple[int, dict[str, Any]]:
    async def call(e: EngineClient) -> ControlResult:
        return await e.acontrol(name, **args)
    return await sup.broadcast(name, call)


async def _abort_sessions(sup: Supervisor, engines: list[int]) -> list[int]:
    """Abort the session on `engines`; the ones whose abort failed."""
    failed = []
    for i in engines:
        try:
            await list(sup.engines)[i].acontrol("abort_weight_update")
        except Exception:  # noqa: BLE001 - reported; the others are still aborted
            failed.append(i)
    return failed


def add_weight_session_supervisor_routes(app: FastAPI) -> None:
    sup: Supervisor = app.state.supervisor
    bodies = {name: body_for(OPS[name]) for name in SESSION_OPS}

    async def start(request: Request) -> Response:
        body = await read_body(bodies["start_weight_update"], request, allow_empty=True)
        assert body is not None
        status, out = await _on_all(sup, "start_weight_update", body.op_args())
        if status != 200:
            opened = [r["engine"] for r in out["engines"] if r["success"]]
            out["aborted_after_failure"] = opened
            out["abort_failed"] = await _abort_sessions(sup, opened)
        return json_response(status, out)

    async def update(request: Request) -> Response:
        body = await read_body(bodies["update_weights"], request)
        assert body is not None
        status, out = await _on_all(sup, "update_weights", body.op_args())
        if status != 200:
            everyone = list(range(len(sup.engines)))
            out["aborted_after_failure"] = everyone
            out["abort_failed"] = await _abort_sessions(sup, everyone)
        return json_response(status, out)

    async def finish(request: Request) -> Response:
        body = await read_body(bodies["finish_weight_update"], request, allow_empty=True)
        assert body is not None
        version = body.op_args().get("weight_version") or f"fleet-{uuid.uuid4().hex[:8]}"
        status, out = await _on_all(sup, "finish_weight_update",
                                    {"weight_version": version})
        versions = sorted({r.get("weight_version") for r in out["engines"]
                           if r["success"]} - {None})
        return json_response(status, {**out, "weight_version": version if status == 200
                                      else None, "engine_versions": versions})

    app.add_api_route("/start_weight_update", start, methods=["POST"],
                      name="start_weight_update")
    app.add_api_route("/update_weights", update, methods=["POST"], name="update_weights")
    app.add_api_route("/finish_weight_update", finish, methods=["POST"],
                      name="finish_weight_update")
