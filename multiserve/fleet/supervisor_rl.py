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
  POST /init_weights_update_group  SGLang's body (control_bodies.InitGroupBody), backend
      "jax": every engine joins the trainer's transfer, all or none (if one fails, the
      others leave the group again); the answer's `pulls_per_update` (the number of
      engines) is how many times the trainer offers each update.
  POST /update_weights_from_distributed  SGLang's body plus `transfer_uuid`
      (control_bodies.DistributedBody): two-phase, as from disk; engine i pulls
      `transfer_uuid + i` (one offer serves one pull: engine/rl/transfer.py), all under
      one weight_version (made here when absent).
  POST /destroy_weights_update_group {group_name?}  on every engine.
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

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.control_ops import transfer_uuid_for
from multiserve.fleet.supervisor import Supervisor, add_fleet_control_routes, json_response
from multiserve.server.control_bodies import (
    DestroyGroupBody,
    DiskBody,
    DistributedBody,
    InitGroupBody,
    flush_note,
)
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
        status, out = await two_phase_update(
            sup, version, body.abort, "update_weights_from_disk", "stage_weights_from_disk",
            lambda i: {"path": path})
        if status == 200 and not body.flush_cache:
            out["message"] = body.note(ControlResult(True, out["message"])).message
        return json_response(status, out)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        args = parse_body(InitGroupBody, await request.body()).op_args()  # torch: 400

        async def join(e: EngineClient) -> ControlResult:
            return await e.acontrol("init_weights_update_group", **args)

        status, out = await sup.broadcast("init_weights_update_group", join)
        n = len(out["engines"])
        if status != 200:  # all or none: the engines that joined leave again
            joined = [r["engine"] for r in out["engines"] if r["success"]]
            engines = list(sup.engines)
            for i in joined:
                await engines[i].acontrol("destroy_weights_update_group",
                                          group_name=args["group_name"])
            out["left_after_failure"] = joined
        else:
            out["message"] = (f"init_weights_update_group: all {n} engines joined the JAX "
                              f"weight transfer as group {args['group_name']!r}; offer each "
                              f"update {n} time(s), engine i pulling transfer_uuid + i")
        return json_response(status, {**out, "group_name": args["group_name"],
                                      "backend": args["backend"], "pulls_per_update": n})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        body = parse_body(DistributedBody, await request.body())
        args = body.op_args()  # one weight_version for every engine
        version, abort = args.pop("weight_version"), args.pop("abort_running")
        base = args.pop("transfer_uuid")
        if base is None:  # derived from the version, then offset per engine
            base = transfer_uuid_for(version)

        def engine_args(i: int) -> dict[str, Any]:
            return {**args, "transfer_uuid": base + i}
        status, out = await two_phase_update(
            sup, version, abort, "update_weights_from_distributed",
            "stage_weights_from_distributed", engine_args)
        if status == 200:
            out["message"] = flush_note(ControlResult(True, out["message"]),
                                        body.flush_cache).message
        return json_response(status, {**out, "group_name": args["group_name"],
                                      "transfer_uuids": [base + i for i in
                                                         range(len(sup.engines))]})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = parse_body(DestroyGroupBody, await request.body(), allow_empty=True)

        async def leave(e: EngineClient) -> ControlResult:
            return await e.acontrol("destroy_weights_update_group",
                                    group_name=body.group_name)

        status, out = await sup.broadcast("destroy_weights_update_group", leave)
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


async def two_phase_update(sup: Supervisor, version: str, abort_running: bool, label: str,
                           stage_op: str, stage_args: Callable[[int], dict[str, Any]]
                           ) -> tuple[int, dict[str, Any]]:
    """Stage on all engines (operation `stage_op`, engine i with `stage_args(i)`), then
    publish on all (or discard on all). (status, body); messages start with `label`."""
    tokens: dict[int, str] = {}  # id(engine client) -> staged token
    index = {id(e): i for i, e in enumerate(sup.engines)}

    async def stage(e: Any) -> Any:
        res = await e.acontrol(stage_op, **stage_args(index[id(e)]), weight_version=version,
                               abort_running=abort_running)
        if res.ok:
            tokens[id(e)] = res.details["token"]
        return res

    status, staged = await sup.broadcast(stage_op, stage)
    if status != 200:
        async def discard(e: Any) -> Any:
            return await e.acontrol("discard_staged_weights", token=tokens.get(id(e)))

        _, discarded = await sup.broadcast("discard_staged_weights", discard)
        bad = [f"engine {r['engine']}: {r['message']}" for r in staged["engines"]
               if not r["success"]]
        return status, {
            "success": False, "phase": "stage", "weight_version": version,
            "message": (f"{label}: NOT applied (every engine keeps its "
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
                     "message": f"{label}: all {len(published['engines'])} "
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
        "message": (f"{label}: published on engines {ok} but FAILED on "
                    + "; ".join(bad) + " -- the fleet serves mixed versions; retry the update"),
        "published_engines": ok, "engines": published["engines"]}
