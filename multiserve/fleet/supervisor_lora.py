"""LoRA adapters on every engine of the fleet, all or none.

Owns `add_lora_supervisor_routes(app)` for an app built by `build_supervisor_app`:
  POST /load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}  (also vLLM's
      /v1/load_lora_adapter) loads on every engine concurrently; if any engine refuses,
      the adapter is unloaded again from the engines that loaded it (with load_inplace:
      the version each had is loaded back in place), and the answer names each refusal.
  POST /unload_lora_adapter  {"lora_name"}  (also /v1/unload_lora_adapter)
      unloads on every engine; if any engine refuses (the adapter is in use there, or
      unknown), the engines that unloaded it load it again from the directory they had
      it from, and the answer names each refusal.
A refusal answers the engines' own status (400 a bad adapter, 404 unknown, 409 slots full
or in use); a timeout or an unavailable engine the broadcast's (504, 503).

Invariants: jax-free (`EngineClient.acontrol` only); the answer comes after every engine
answered; success only if every engine ended with the change. Not a transaction: between
a partial load and its undo, a request sent straight to an engine's own port may use
the adapter there (then the undo is refused "in use" and the answer lists that engine);
an adapter loaded from in-memory tensors cannot be reloaded by an undone unload.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.control_ops import OPS
from multiserve.fleet.supervisor import Supervisor, json_response
from multiserve.server.control_bodies import body_for
from multiserve.server.http_utils import parse_body
from multiserve.types import ControlResult, EngineClient

LOAD, UNLOAD = OPS["load_lora_adapter"], OPS["unload_lora_adapter"]


def add_lora_supervisor_routes(app: FastAPI) -> None:
    sup: Supervisor = app.state.supervisor
    load_body, unload_body = body_for(LOAD), body_for(UNLOAD)
    assert LOAD.route is not None and UNLOAD.route is not None and load_body and unload_body

    async def load(request: Request) -> Response:
        body = parse_body(load_body, await request.body()).op_args()
        return json_response(*await load_everywhere(sup, body["lora_name"], body["lora_path"],
                                                    bool(body.get("load_inplace", False))))

    async def unload(request: Request) -> Response:
        body = parse_body(unload_body, await request.body()).op_args()
        return json_response(*await unload_everywhere(sup, body["lora_name"]))

    for path in LOAD.route.paths:
        app.add_api_route(path, load, methods=["POST"], name="load_lora_adapter")
    for path in UNLOAD.route.paths:
        app.add_api_route(path, unload, methods=["POST"], name="unload_lora_adapter")


def _status(status: int, out: dict[str, Any]) -> int:
    """Refusals answer the engines' own status (the highest); other failures the
    broadcast's."""
    if status != 400:
        return status
    return max([int(r.get("http_status", 400)) for r in out["engines"] if not r["success"]],
               default=400)


def _refusals(out: dict[str, Any]) -> str:
    return "; ".join(f"engine {r['engine']}: {r['message']}" for r in out["engines"]
                     if not r["success"])


Run = Callable[[EngineClient], Awaitable[ControlResult]]


async def _all_or_none(sup: Supervisor, op: str, do: Run, undo_op: str, undo: Run,
                       done: str, kept: str, undo_failed: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of `do` on every engine (broadcast as `op`); where an engine refused,
    `undo` (broadcast as `undo_op`) on every engine, which puts back the engines `do`
    changed. Messages: `done` on success, `kept` when undone, `undo_failed` names the
    engines the undo failed on."""
    status, out = await sup.broadcast(op, do)
    if status == 200:
        return 200, {"success": True, "message": f"{op}: {done} on all "
                     f"{len(out['engines'])} engines", "engines": out["engines"]}
    _, undone = await sup.broadcast(undo_op, undo)
    left = [r["engine"] for r in undone["engines"] if not r["success"]]
    note = f" ({undo_failed} FAILED on engines {left}: {_refusals(undone)})" if left else ""
    return _status(status, out), {
        "success": False, "message": f"{op}: {kept}{note}: {_refusals(out)}",
        "failed_engines": [r["engine"] for r in out["engines"] if not r["success"]],
        "engines": out["engines"], "undo": undone["engines"]}


async def load_everywhere(sup: Supervisor, name: str, path: str, inplace: bool = False
                          ) -> tuple[int, dict[str, Any]]:
    """(status, body) of loading adapter `name` from `path` on every engine, or none;
    `inplace`: replacing the version an engine has (its undo loads that one back in place,
    from the directory it came from)."""
    loaded: set[int] = set()
    before: dict[int, str] = {}  # inplace: the source of the version an engine had

    async def load(e: EngineClient) -> ControlResult:
        if inplace:
            listed = await e.acontrol("list_lora_adapters")
            source = {a["name"]: a["source"] for a in listed.details["adapters"]}.get(name)
            if source is not None:
                before[id(e)] = source
        res = await e.acontrol("load_lora_adapter", lora_name=name, lora_path=path,
                               load_inplace=inplace)
        if res.ok:
            loaded.add(id(e))
        return res

    async def undo(e: EngineClient) -> ControlResult:
        if id(e) not in loaded:
            return ControlResult(True, "not loaded here")
        if id(e) in before:
            return await e.acontrol("load_lora_adapter", lora_name=name,
                                    lora_path=before[id(e)], load_inplace=True)
        return await e.acontrol("unload_lora_adapter", lora_name=name)

    return await _all_or_none(sup, "load_lora_adapter", load, "unload_lora_adapter", undo,
                              f"{name!r} loaded", f"{name!r} NOT loaded (no engine keeps it)",
                              "the undo")


async def unload_everywhere(sup: Supervisor, name: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of unloading adapter `name` on every engine, or none."""
    sources: dict[int, str] = {}

    async def unload(e: EngineClient) -> ControlResult:
        listed = await e.acontrol("list_lora_adapters")
        source = {a["name"]: a["source"] for a in listed.details["adapters"]}.get(name)
        res = await e.acontrol("unload_lora_adapter", lora_name=name)
        if res.ok and source is not None:
            sources[id(e)] = source
        return res

    async def undo(e: EngineClient) -> ControlResult:
        if id(e) not in sources:
            return ControlResult(True, "not unloaded here")
        return await e.acontrol("load_lora_adapter", lora_name=name, lora_path=sources[id(e)])

    return await _all_or_none(sup, "unload_lora_adapter", unload, "load_lora_adapter", undo,
                              f"{name!r} unloaded",
                              f"{name!r} NOT unloaded (every engine that had it keeps it)",
                              "reloading")
