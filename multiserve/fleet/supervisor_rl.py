"""Fleet-wide RL control on the supervisor: memory release/resume and two-phase weight
updates.

Owns `add_rl_supervisor_routes(app, engines=None)` for an app built by
`build_supervisor_app`:
  POST /update_weights_from_disk   sglang's body (see control_bodies.DiskBody: "model_path",
      "weight_version"? -- made once for all engines when absent --, "abort_all_requests"?,
      ...) or {"path", "abort_running"?}.
      Phase 1 stages the checkpoint on every engine (concurrently: read, validate, copy to
      its devices); only if EVERY engine staged does phase 2 publish on all of them.
      If any engine fails to stage, every staged copy is discarded, no engine changes
      weights, and the answer names each failing engine and its reason.
  GET  /get_weight_version         {"weight_version", "agree", "engines": [...]}
  and a broadcast route per RL operation whose row in multiserve/control_ops.py names the
  "each" merge (supervisor.add_fleet_control_routes): /release_memory_occupation,
  /resume_memory_occupation, /get_weights_by_name.

Invariants: jax-free (`EngineClient.acontrol` only, which the fleet's workers implement);
answers come after every engine answered;
HTTP 200 only if every engine succeeded. A publish is refused by an engine only if its
state changed between the phases (staging holds an idle engine paused so that requests
arriving meanwhile cannot make it refuse); the answer then lists the engines on each
version (no silent partial success).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.fleet.supervisor import Supervisor, add_fleet_control_routes, json_response
from multiserve.server.control_bodies import DiskBody
from multiserve.server.http_utils import parse_body
from multiserve.types import ControlResult, EngineClient


def add_rl_supervisor_routes(app: FastAPI, engines: Sequence[EngineClient] | None = None
                             ) -> None:
    """Add the fleet-wide RL routes. `engines` defaults to the app's supervisor engines
    (read at every request, so restarted engines are seen)."""
    base: Supervisor = app.state.supervisor
    sup = base if engines is None or engines is base.engines else Supervisor(
        engines, engine_ports=base.engine_ports, control_timeout=base.control_timeout)

    add_fleet_control_routes(app, "rl")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = parse_body(DiskBody, await request.body())
        path, version = body.dir(), body.version()  # one version for every engine
        status, out = await two_phase_update(sup, path, version, body.abort)
        if status == 200 and not body.flush_cache:
            out["message"] = body.note(ControlResult(True, out["message"])).message
        return json_response(status, out)

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        """Per engine, and whether they agree (then `weight_version` is theirs; else
        null): sglang's answer shape, one level up."""
        states = await sup.engine_states()
        per = [{"engine": s["engine"], "port": s["port"],
                "weight_version": (s["state"] or {}).get("weight_version")} for s in states]
        versions = {p["weight_version"] for p in per}
        agree = len(versions) == 1 and None not in versions
        return json_response(200 if all(s["state"] is not None for s in states) else 503, {
            "weight_version": next(iter(versions)) if agree else None, "agree": agree,
            "engines": per})


async def two_phase_update(sup: Supervisor, path: str, version: str,
                           abort_running: bool = False) -> tuple[int, dict[str, Any]]:
    """Stage on all engines, then publish on all (or discard on all). (status, body)."""
    tokens: dict[int, str] = {}  # id(engine client) -> staged token

    async def stage(e: Any) -> Any:
        res = await e.acontrol("stage_weights_from_disk", path=path, weight_version=version,
                               abort_running=abort_running)
        if res.ok:
            tokens[id(e)] = res.details["token"]
        return res

    status, staged = await sup.broadcast("stage_weights_from_disk", stage)
    if status != 200:
        async def discard(e: Any) -> Any:
            return await e.acontrol("discard_staged_weights", token=tokens.get(id(e)))

        _, discarded = await sup.broadcast("discard_staged_weights", discard)
        bad = [f"engine {r['engine']}: {r['message']}" for r in staged["engines"]
               if not r["success"]]
        return status, {
            "success": False, "phase": "stage", "weight_version": version,
            "message": (f"update_weights_from_disk: NOT applied (every engine keeps its "
                        f"weights): {len(bad)} of {len(staged['engines'])} engine(s) failed "
                        f"to stage: " + "; ".join(bad)),
            "failed_engines": [r["engine"] for r in staged["engines"] if not r["success"]],
            "engines": staged["engines"], "discard": discarded["engines"]}

    async def publish(e: Any) -> Any:
        return await e.acontrol("publish_staged_weights", token=tokens[id(e)],
                               abort_running=abort_running)

    status, published = await sup.broadcast("publish_staged_weights", publish)
    if status == 200:
        return 200, {"success": True, "phase": "publish", "weight_version": version,
                     "message": f"update_weights_from_disk: all {len(published['engines'])} "
                                f"engines now serve weight version {version!r}",
                     "engines": published["engines"]}
    ok = [r["engine"] for r in published["engines"] if r["success"]]

    async def discard_left(e: Any) -> Any:  # no-op on the engines that published
        return await e.acontrol("discard_staged_weights", token=tokens.get(id(e)))

    await sup.broadcast("discard_staged_weights", discard_left)
    bad = [f"engine {r['engine']}: {r['message']}" for r in published["engines"]
           if not r["success"]]
    return status, {
        "success": False, "phase": "publish", "weight_version": version,
        "message": (f"update_weights_from_disk: published on engines {ok} but FAILED on "
                    + "; ".join(bad) + " -- the fleet serves mixed versions; retry the update"),
        "published_engines": ok, "engines": published["engines"]}
