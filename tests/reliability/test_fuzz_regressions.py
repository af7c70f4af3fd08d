"""Bugs the schema fuzzer found, pinned (in process, ASGI: the network is not the point)."""

from __future__ import annotations

from typing import Any

import httpx

from multiserve.types import ControlResult


class StagingEngine:
    """Just enough of an engine for the supervisor's two-phase update."""

    model_name, context_len = "fake", 64

    def __init__(self) -> None:
        self.paths: list[Any] = []

    def health(self) -> tuple[bool, str]:
        return True, "ok"

    async def acontrol(self, name: str, /, **args: Any) -> ControlResult:
        if name == "stage_weights_from_disk":
            path = args["path"]
            self.paths.append(path)
            if not isinstance(path, str):
                raise TypeError(f"expected a path string, got {path!r}")
            return ControlResult(False, f"{path or '.'}: no *.safetensors file")
        if name == "discard_staged_weights":
            return ControlResult(True, "nothing staged")
        if name == "publish_staged_weights":
            raise AssertionError("never reached: staging failed")
        raise NotImplementedError(name)


async def test_empty_weight_path_is_a_400_not_a_500() -> None:
    """`{"path": ""}` used to reach the engines as None (`path or model_path`): a TypeError,
    answered 500. An empty path is a path the engines refuse: 400, with the error body."""
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes

    engine = StagingEngine()
    app = build_supervisor_app([engine])  # type: ignore[list-item]
    add_rl_supervisor_routes(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://sup") as http:
        r = await http.post("/update_weights_from_disk", json={"path": "",
                                                               "weight_version": "v"})
    assert r.status_code == 400, r.text
    assert engine.paths == [""]
    assert r.json()["error"]["message"] and "NOT applied" in r.json()["message"]
