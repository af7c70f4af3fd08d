"""The supervisor: one HTTP app that drives every engine of the fleet at once.

Owns: broadcasting control operations to all engines concurrently and aggregating their
answers (a route per operation of multiserve/control_ops.py whose row names a `fleet`
merge: `add_fleet_control_routes`; the core group here, the RL group from
supervisor_rl.py), fleet health, server info, /v1/models, Prometheus metrics, and
restarting one engine through the launcher's `restart` callback.

Invariants:
- Jax-free: talks to engines only through `EngineClient` (multiserve.types:
  `acontrol`); never imports `engine/` or `model/`.
- A broadcast answers only after every engine answered (or timed out): a fleet pause is
  a barrier because each engine's pause is one. HTTP 200 only if every engine
  succeeded; otherwise an error status and the per-engine detail (no silent partial
  success). An engine that raises is reported with the exception text; the supervisor
  itself never fails because an engine did.
- `engines` is read at every request (not copied), so a launcher may swap an entry
  when it rebuilds an engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from multiserve.config import DEFAULT_MAX_REQUEST_BYTES
from multiserve.control_ops import OPS, ControlOp, Group
from multiserve.fleet.supervisor_bodies import RestartBody, fleet_body_for
from multiserve.fleet.supervisor_metrics import render_metrics
from multiserve.fleet.supervisor_openapi import document_supervisor_app
from multiserve.host.process_memory import process_memory
from multiserve.server.body_limit import limit_body
from multiserve.server.control_routes import read_body
from multiserve.server.errors import ApiError, bad_request, with_error
from multiserve.server.http_utils import error_json, parse_body
from multiserve.types import ControlResult, EngineClient, EngineUnavailable

RestartFn = Callable[[int], Awaitable[ControlResult]]
EngineCall = Callable[[EngineClient], Awaitable[ControlResult]]

# Failure kinds, most severe first, and their HTTP status; a response takes the status of
# the worst failure present.
_STATUS = {"error": 500, "timeout": 504, "unavailable": 503, "refused": 400}
_WORST_FIRST = tuple(_STATUS)


class Supervisor:
    """Fleet-wide operations over a sequence of engine clients (see module docstring)."""

    def __init__(self, engines: Sequence[EngineClient], *, restart: RestartFn | None = None,
                 engine_ports: list[int] | None = None, control_timeout: float | None = 600.0,
                 state_timeout: float = 10.0) -> None:
        assert engine_ports is None or len(engine_ports) == len(engines)
        self.engines = engines
        self.restart_fn = restart
        self.engine_ports = engine_ports
        self.control_timeout = control_timeout
        self.state_timeout = state_timeout
        self.created = int(time.time())
        self.restarts: list[int] = [0] * len(engines)
        self.control_counts: dict[tuple[str, str], int] = {}
        self._restarting: set[int] = set()

    def port(self, i: int) -> int | None:
        return self.engine_ports[i] if self.engine_ports is not None else None

    async def broadcast(self, name: str, call: EngineCall, *,
                        timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """Run `call` on every engine concurrently; returns (HTTP status, body).

        Success iff every engine answered ok within `timeout` (default: the app's
        control timeout); otherwise the status of the worst failure (`_STATUS`).
        """
        timeout = self.control_timeout if timeout is None else timeout
        engines = list(self.engines)
        replies = await asyncio.gather(*(self._call_one(i, e, call, timeout)
                                         for i, e in enumerate(engines)))
        failures = [r["failure"] for r in replies if r["failure"] is not None]
        ok = not failures
        status = 200 if ok else _STATUS[min(failures, key=_WORST_FIRST.index)]
        key = (name, "success" if ok else "failure")
        self.control_counts[key] = self.control_counts.get(key, 0) + 1
        if ok:
            message = f"{name}: all {len(engines)} engines succeeded"
        else:
            bad = [f"engine {r['engine']}: {r['message']}" for r in replies if r["failure"]]
            message = f"{name}: {len(bad)} of {len(engines)} engines failed: " + "; ".join(bad)
        return status, {"success": ok, "message": message, "engines": replies}

    async def _call_one(self, i: int, engine: EngineClient, call: EngineCall,
                        timeout: float | None) -> dict[str, Any]:
        reply: dict[str, Any] = {"engine": i, "port": self.port(i)}
        try:
            result = await asyncio.wait_for(call(engine), timeout)
        except TimeoutError:
            return {**reply, "success": False, "failure": "timeout",
                    "message": f"no answer within {timeout:g} s"}
        except EngineUnavailable as e:
            return {**reply, "success": False, "failure": "unavailable",
                    "message": f"engine unavailable: {e}"}
        except ValueError as e:  # the engine rejected an argument (e.g. an unknown tag)
            return {**reply, "success": False, "failure": "refused", "message": str(e)}
        except Exception as e:  # noqa: BLE001 - an engine's failure is reported, not raised
            return {**reply, "success": False, "failure": "error",
                    "message": f"{type(e).__name__}: {e}"}
        return {**result.to_dict(), **reply, "success": result.ok,
                "failure": None if result.ok else "refused"}

    async def engine_states(self) -> list[dict[str, Any]]:
        """Per engine: health() plus its internal state (or the error fetching it)."""
        async def one(i: int, engine: EngineClient) -> dict[str, Any]:
            healthy, reason = engine.health()
            entry: dict[str, Any] = {"engine": i, "port": self.port(i), "healthy": healthy,
                                     "reason": reason, "model": engine.model_name}
            try:
                entry["state"] = await asyncio.wait_for(
                    engine.acontrol("get_internal_state"), self.state_timeout)
            except Exception as e:  # noqa: BLE001 - reported per engine
                entry["state"], entry["state_error"] = None, f"{type(e).__name__}: {e}"
            return entry
        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines))))

    async def restart(self, i: int) -> tuple[int, dict[str, Any]]:
        base = {"engine": i, "port": self.port(i)}
        if self.restart_fn is None:
            return 501, {**base, "success": False, "message": "this fleet cannot restart engines"}
        if i in self._restarting:
            return 409, {**base, "success": False, "message": f"engine {i} is already restarting"}
        self._restarting.add(i)
        try:
            result = await self.restart_fn(i)
        except Exception as e:  # noqa: BLE001 - reported, the supervisor stays up
            return 500, {**base, "success": False, "message": f"{type(e).__name__}: {e}"}
        finally:
            self._restarting.discard(i)
        if result.ok:
            self.restarts[i] += 1
        return (200 if result.ok else 500), {**result.to_dict(), **base}


def build_supervisor_app(engines: Sequence[EngineClient], *, restart: RestartFn | None = None,
                         engine_ports: list[int] | None = None,
                         control_timeout: float | None = 600.0,
                         max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                         enable_memory_saver: bool = False) -> FastAPI:
    """The supervisor's FastAPI app; `app.state.supervisor` is its `Supervisor`.
    `max_request_bytes` and `enable_memory_saver`: its `ServerConfig`'s (a body bound, and
    the sglang server argument /get_server_info reports as set)."""
    sup = Supervisor(engines, restart=restart, engine_ports=engine_ports,
                     control_timeout=control_timeout)
    app = FastAPI(title="multiserve supervisor")
    app.state.supervisor = sup

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_json(exc)

    add_fleet_control_routes(app, "core")  # pause, continue, abort, flush

    @app.post("/restart_engine")
    async def restart_engine(request: Request) -> Response:
        body = parse_body(RestartBody, await request.body(), allow_empty=True)
        if not 0 <= body.engine < len(sup.engines):
            raise bad_request(f"engine must be in [0, {len(sup.engines) - 1}], "
                              f"got {body.engine}", "engine")
        status, out = await sup.restart(body.engine)
        return json_response(status, out)

    @app.get("/health")
    async def health() -> Response:
        entries = []
        for s in await sup.engine_states():
            state = s["state"] or {}
            entries.append({k: s[k] for k in ("engine", "port", "healthy", "reason")}
                           | {"paused": state.get("engine_paused"),
                              "running": state.get("running_batch_size"),
                              "waiting": state.get("waiting_queue_size")}
                           | ({"state_error": s["state_error"]} if "state_error" in s else {}))
        ok = all(e["healthy"] for e in entries)
        return json_response(200 if ok else 503, {"healthy": ok, "engines": entries})

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        states = await sup.engine_states()
        ok = all(s["state"] is not None for s in states)
        plans = [s["state"]["determinism"] for s in states if s["state"] is not None]
        return json_response(200 if ok else 503, {
            "num_engines": len(states), "enable_memory_saver": enable_memory_saver,
            "max_request_bytes": max_request_bytes, "engines": states,
            "internal_states": [s["state"] for s in states],
            "memory": {"process": process_memory(),
                       "engines_total": engines_memory_total(
                           [s["state"] for s in states if s["state"] is not None])},
            # verified on every engine, and whether they all run one plan (one key)
            "determinism": {"verified": ok and all(p["verified"] for p in plans),
                            "same_plan": len({p["key_hash"] for p in plans}) <= 1,
                            "key_hashes": [p["key_hash"] for p in plans]}})

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = render_metrics(sup, await sup.engine_states())
        return Response(content=text, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        by_name: dict[str, dict[str, Any]] = {}
        for i, e in enumerate(sup.engines):
            entry = by_name.setdefault(e.model_name, {
                "id": e.model_name, "object": "model", "created": sup.created,
                "owned_by": "multiserve", "root": e.model_name,
                "max_model_len": e.context_len, "engines": []})
            entry["engines"].append(i)
        return json_response(200, {"object": "list", "data": list(by_name.values())})

    document_supervisor_app(app)  # the OpenAPI document declares every body and answer
    limit_body(app, max_request_bytes)
    return app


# the byte and token counts of an engine's "memory" block (engine/memory_report.py) that
# add up over engines
_MEMORY_SUMS = ("weights_bytes", "weights_params_bytes", "weights_copies_bytes",
                "weights_canonical_bytes", "kv_pool_bytes", "kv_pool_tokens")


def engines_memory_total(states: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The sums over `states` (engines' internal states) of what each holds: weights, KV
    pool, and compiled programs (their count and scratch bytes)."""
    memories = [s.get("memory") or {} for s in states]
    out = {k: sum(int(m.get(k) or 0) for m in memories) for k in _MEMORY_SUMS}
    for key in ("count", "temp_bytes_total"):
        out[f"programs_{key}"] = sum(int((m.get("programs") or {}).get(key) or 0)
                                     for m in memories)
    return out


def fleet_ops(group: Group) -> list[ControlOp]:
    """The operations of `group` the supervisor broadcasts (merge "each" or "sum_aborted";
    the two-phase update is supervisor_rl.py's), in table order."""
    return [op for op in OPS.values() if op.group == group and op.route is not None
            and op.fleet in ("each", "sum_aborted")]


def _sum_aborted(status: int, out: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """A rid lives on (at most) one engine; the others answer "not here" and succeed."""
    out["aborted"] = sum(int(r.get("aborted") or 0) for r in out["engines"])
    rid = args.get("rid")
    if status == 200 and rid is not None and out["aborted"] == 0:
        out["message"] = f"abort_request: no engine has a live request with rid {rid!r}"
    return out


MERGES: dict[str, Callable[[int, dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "each": lambda status, out, args: out,
    "sum_aborted": _sum_aborted,
}


def add_fleet_control_routes(app: FastAPI, group: Group) -> None:
    """One broadcast route per operation of `group` in `fleet_ops`: parse the body (the
    supervisor's spelling, supervisor_bodies.py; 400 on a bad body, before any engine is
    asked), run the operation on every engine concurrently, answer the aggregate merged
    as the row says."""
    sup: Supervisor = app.state.supervisor
    for op in fleet_ops(group):
        assert op.route is not None and op.fleet is not None
        app.add_api_route(op.route.path, _fleet_route(sup, op, fleet_body_for(op)),
                          methods=list(op.route.methods), name=op.name)


def _fleet_route(sup: Supervisor, op: ControlOp, model: type[Any]
                 ) -> Callable[[Request], Awaitable[Response]]:
    merge = MERGES[op.fleet or "each"]

    async def route(request: Request) -> Response:
        body = await read_body(model, request, allow_empty=True)
        assert body is not None
        ready = body.ready_answer()
        args = body.op_args() if ready is None else {}

        async def call(e: EngineClient) -> ControlResult:
            if ready is not None:
                return ready
            return body.answer(op.name, await e.acontrol(op.name, **args))

        status, out = await sup.broadcast(op.name, call)
        return json_response(status, merge(status, out, args))

    return route


def json_response(status: int, content: Any) -> Response:
    """JSON that tolerates engine-state values JSON does not know (numpy scalars, ...).
    A failure (status >= 400) also carries the OpenAI `error` object."""
    if isinstance(content, dict):
        content = with_error(content, status, code="refused" if status < 500 else "failed")
    text = json.dumps(content, default=_plain)
    return Response(content=text, status_code=status, media_type="application/json")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)
