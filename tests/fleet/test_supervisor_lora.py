"""LoRA on the supervisor (fleet/supervisor_lora.py): an adapter is loaded on every engine
or on none, and unloaded from every engine or from none. Two real tiny engines (one LoRA
slot each) behind the supervisor app, in process (ASGI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_checkpoints import loaded, write_peft_dir

from multiserve.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.reliability.tiny_model import tiny_engine_fields, write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny-fleet-lora"))
    cfg = EngineConfig(model_path=str(model), **tiny_engine_fields(max_loras_per_batch=1,
                                                                   max_lora_rank=4))
    engs = [Engine(cfg), Engine(cfg)]
    yield engs
    for e in engs:
        e.shutdown()


def _names(engine: Any) -> list[str]:
    return [a["name"] for a in engine.list_lora_adapters()]


async def test_load_and_unload_are_all_or_none(engines: list[Any], tmp_path: Path) -> None:
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_lora import add_lora_supervisor_routes

    a, b = engines
    app = build_supervisor_app(engines)
    add_lora_supervisor_routes(app)
    cfg = a.model_config
    x, y = write_peft_dir(tmp_path / "x", cfg, 2, 1), write_peft_dir(tmp_path / "y", cfg, 2, 2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        r = await http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(x)})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert _names(a) == _names(b) == ["x"]
        # engine b's only slot is taken by another adapter: y lands on neither engine
        assert (await http.post("/unload_lora_adapter", json={"lora_name": "x"})
                ).status_code == 200
        loaded(b.load_lora_adapter("z", str(y)))
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "y",
                                                           "lora_path": str(y)})
        assert r.status_code == 409 and "NOT loaded" in r.json()["message"], r.text
        assert r.json()["failed_engines"] == [1]
        assert (_names(a), _names(b)) == ([], ["z"])
        # unloading z: engine a does not have it (404), engine b keeps it
        r = await http.post("/unload_lora_adapter", json={"lora_name": "z"})
        assert r.status_code == 404 and r.json()["failed_engines"] == [0], r.text
        assert (_names(a), _names(b)) == ([], ["z"])
        loaded(b.unload_lora_adapter("z"))
        # unloading x while a request uses it on engine a: engine b reloads it
        assert (await http.post("/load_lora_adapter", json={
            "lora_name": "x", "lora_path": str(x)})).status_code == 200
        a.pause_generation("in_place")
        try:
            a.submit_many([GenerateRequest(rid="held", input_ids=(5, 6, 7), lora_name="x",
                                           sampling=SamplingParams(max_new_tokens=4))],
                          [lambda d: None])
            r = await http.post("/unload_lora_adapter", json={"lora_name": "x"})
            assert r.status_code == 409 and "in use by 1 live request" in r.text, r.text
            assert _names(a) == _names(b) == ["x"]
            assert b.list_lora_adapters()[0]["source"] == str(x)
        finally:
            a.abort_request(abort_all=True)
            a.continue_generation()
        r = await http.post("/unload_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 200 and _names(a) == _names(b) == []


async def test_load_inplace_is_all_or_none(engines: list[Any], tmp_path: Path) -> None:
    """load_inplace on every engine: where one refuses (its one slot still held by a live
    request on the old version), the engines that replaced it load their old version back
    in place; once nothing holds it, every engine serves the new version."""
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_lora import add_lora_supervisor_routes

    a, b = engines
    app = build_supervisor_app(engines)
    add_lora_supervisor_routes(app)
    cfg = a.model_config
    x, y = write_peft_dir(tmp_path / "x", cfg, 2, 1), write_peft_dir(tmp_path / "y", cfg, 2, 2)

    def sources() -> list[list[str]]:
        return [[s["source"] for s in e.list_lora_adapters()] for e in (a, b)]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        assert (await http.post("/load_lora_adapter", json={
            "lora_name": "x", "lora_path": str(x)})).status_code == 200
        body = {"lora_name": "x", "lora_path": str(y), "load_inplace": True}
        a.pause_generation("in_place")
        try:
            a.submit_many([GenerateRequest(rid="held", input_ids=(5, 6, 7), lora_name="x",
                                           sampling=SamplingParams(max_new_tokens=4))],
                          [lambda d: None])
            r = await http.post("/load_lora_adapter", json=body)
            assert r.status_code == 409 and r.json()["failed_engines"] == [0], r.text
            assert sources() == [[str(x)], [str(x)]]  # engine b put version x back
        finally:
            a.abort_request(abort_all=True)
            a.continue_generation()
        r = await http.post("/load_lora_adapter", json=body)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert sources() == [[str(y)], [str(y)]]
        assert (await http.post("/unload_lora_adapter", json={"lora_name": "x"})
                ).status_code == 200
