"""The control routes are derived from the table of operations (multiserve/control_ops.py):
the sglang-compatible route set stays exactly what RL clients call, and a row added to the
table gets its engine route, its supervisor broadcast and its OpenAPI entries with no other
edit. In process (ASGI), jax-free: the engine is a recorder of `acontrol` calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from multiserve import control_ops
from multiserve.control_ops import OPS, ControlOp, Route
from multiserve.fleet.supervisor import build_supervisor_app
from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
from multiserve.server.control_routes import add_control_routes, add_rl_routes
from multiserve.server.errors import ApiError
from multiserve.server.http_utils import error_json
from multiserve.types import ControlResult

ENGINE_ROUTES = {
    ("POST", "/pause_generation"), ("POST", "/continue_generation"),
    ("POST", "/abort_request"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
    ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("POST", "/update_weights_from_disk"), ("POST", "/stage_weights_from_disk"),
    ("POST", "/publish_staged_weights"), ("POST", "/discard_staged_weights"),
    ("GET", "/get_weights_by_name"), ("POST", "/get_weights_by_name"),
    # LoRA: sglang's paths and vLLM's (an alias of the same operation)
    ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    # the weight-update session: vLLM's routes (and its abort)
    ("POST", "/start_weight_update"), ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"), ("POST", "/abort_weight_update"),
    # SGLang's weights-update group (backend "jax": a JAX trainer's transfer)
    ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group")}
FLEET_ROUTES = {
    ("POST", "/pause_generation"), ("POST", "/continue_generation"),
    ("POST", "/abort_request"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
    ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("GET", "/get_weights_by_name"), ("POST", "/get_weights_by_name"),
    ("POST", "/update_weights_from_disk"), ("POST", "/abort_weight_update"),
    ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group")}


class Recorder:
    """An EngineClient that answers every control operation ok and records the call."""

    model_name, context_len = "m", 64

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def health(self) -> tuple[bool, str]:
        return True, "ok"

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        self.calls.append((name, args))
        return ControlResult(True, f"{name} done", {"aborted": 1})


def _routes(app: FastAPI) -> set[tuple[str, str]]:
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", ())
            if (m, r.path) in ENGINE_ROUTES | FLEET_ROUTES or r.path == "/drain_now"}


def _engine_app(engine: Recorder) -> FastAPI:
    """The control routes as build_app adds them (with its error mapping)."""
    app = FastAPI()

    async def on_api_error(_: Any, exc: ApiError) -> Any:
        return error_json(exc)

    app.add_exception_handler(ApiError, on_api_error)
    add_control_routes(app, engine, "core")
    add_rl_routes(app, engine)
    return app


def test_every_existing_control_route_is_derived_unchanged() -> None:
    assert _routes(_engine_app(Recorder())) == ENGINE_ROUTES
    sup = build_supervisor_app([Recorder()])
    add_rl_supervisor_routes(sup)
    assert _routes(sup) == FLEET_ROUTES
    assert {op.name for op in OPS.values() if op.route is not None} == {
        p.strip("/") for _, p in ENGINE_ROUTES if not p.startswith("/v1/")}


@dataclass(frozen=True)
class Drain:
    within_s: float = 1.0
    label: str | None = None


async def test_a_new_row_gets_its_routes_broadcast_and_documents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = ControlOp("drain_now", Drain, "core", route=Route("/drain_now"), fleet="each")
    monkeypatch.setitem(control_ops.OPS, op.name, op)
    engine = Recorder()
    app = _engine_app(engine)
    sup = build_supervisor_app([Recorder(), Recorder()])
    engines = sup.state.supervisor.engines
    for a in (app, sup):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a),
                                     base_url="http://t") as http:
            r = await http.post("/drain_now", json={"within_s": 2.5})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            bad = await http.post("/drain_now", json={"within_s": "soon"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "within_s"
            unknown = await http.post("/drain_now", json={"nope": 1})
            assert unknown.status_code == 400, unknown.text
            if a is sup:  # the supervisor's document declares every route it serves
                assert "/drain_now" in (await http.get("/openapi.json")).json()["paths"]
    assert engine.calls == [("drain_now", {"within_s": 2.5, "label": None})]
    assert [e.calls for e in engines] == [[("drain_now", {"within_s": 2.5, "label": None})]] * 2


def test_unknown_operation_and_bad_argument_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown control operation"):
        control_ops.control_request("no_such_op")
    with pytest.raises(ValueError, match="mode"):
        control_ops.control_request("pause_generation", mode="later")
    with pytest.raises(ValueError, match="tags"):
        control_ops.control_request("release_memory_occupation", tags=["cuda_graph"])
    with pytest.raises(ValueError, match="truncate_size"):
        control_ops.control_request("get_weights_by_name", name="x", truncate_size=0)
    assert control_ops.control_request("resume_memory_occupation", tags=None).tags == (
        "weights", "kv_cache")
