"""vLLM's pause routes on the supervisor: every engine, all or none.

Owns `add_vllm_pause_supervisor_routes(app)` for an app built by `build_supervisor_app`:
  POST /pause?mode=...&clear_cache=...  (vLLM's query parameters: server/vllm_pause.py)
      pauses every engine concurrently and answers once every engine's pause holds
      ("wait": once each engine's live requests have finished). 200 {"status": "paused",
      "engines": [...]} only if every engine paused; otherwise the engines this call
      paused are continued again (`resumed_after_failure`: none stays paused because of
      a failed fleet pause) and the answer has the worst failure's status and each
      engine's reason.
  POST /resume     continues every engine: {"status": "resumed", "engines": [...]}
  GET  /is_paused  {"is_paused": true iff every engine is paused, "engines": [...]}

Invariants: jax-free (`EngineClient.acontrol` only); answers come after every engine
answered; the query is the engine route's (`PauseQuery`), checked before any engine is
asked.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.fleet.supervisor import Supervisor, json_response
from multiserve.server.vllm_pause import PauseQuery, is_paused
from multiserve.types import ControlResult, EngineClient


def add_vllm_pause_supervisor_routes(app: FastAPI) -> None:
    sup: Supervisor = app.state.supervisor

    async def pause(request: Request) -> Response:
        args = PauseQuery.parse(request.query_params).op_args()
        status, out = await fleet_pause(sup, args)
        return json_response(status, out)

    async def resume(_: Request) -> Response:
        async def call(e: EngineClient) -> ControlResult:
            return await e.acontrol("continue_generation")

        status, out = await sup.broadcast("resume", call)
        return json_response(status, {"status": "resumed" if status == 200 else "failed",
                                      **out})

    async def paused(_: Request) -> Response:
        states = await sup.engine_states()
        each = [{"engine": s["engine"], "port": s["port"],
                 "is_paused": is_paused(s["state"]) if s["state"] is not None else None}
                for s in states]
        ok = all(e["is_paused"] is not None for e in each)
        return json_response(200 if ok else 503, {
            "is_paused": ok and all(e["is_paused"] for e in each), "engines": each})

    app.add_api_route("/pause", pause, methods=["POST"], name="vllm_pause")
    app.add_api_route("/resume", resume, methods=["POST"], name="vllm_resume")
    app.add_api_route("/is_paused", paused, methods=["GET"], name="vllm_is_paused")


async def fleet_pause(sup: Supervisor, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Pause every engine with pause_generation's `args`; if any engine fails, continue
    the ones this call paused (not those already paused before it)."""
    async def call(e: EngineClient) -> ControlResult:
        return await e.acontrol("pause_generation", **args)

    status, out = await sup.broadcast("pause", call)
    if status == 200:
        return status, {"status": "paused", **out}
    undo = [r["engine"] for r in out["engines"]
            if r["success"] and not r.get("already_paused")]
    engines = list(sup.engines)
    for i in undo:
        try:
            await engines[i].acontrol("continue_generation")
        except Exception:  # noqa: BLE001 - reported below; the others are still undone
            out.setdefault("undo_failed", []).append(i)
    out["resumed_after_failure"] = undo
    return status, {"status": "failed", **out}
