"""One vocabulary per concept (issue 21): every HTTP body with a pause-mode field, the
engine's and the supervisor's, accepts exactly `types.PAUSE_MODES`, so a body cannot
grow its own spelling. Jax-free."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import multiserve.server as server
from multiserve.fleet import supervisor_bodies, supervisor_openapi
from multiserve.server import api_schema
from multiserve.types import ASLEEP, PAUSE_MODES, PauseMode, asleep_reason, is_asleep

# Each route's default mode is sglang's, and differs on purpose.
DEFAULTS = {"server.control_bodies.PauseBody": "abort",
            "server.control_bodies.ReleaseBody": "retract",
            "server.vllm_pause.PauseQuery": "abort",  # vLLM's /pause (query parameters)
            "fleet.supervisor_bodies.PauseBody": "abort"}


def _models_in(module: Any) -> set[type[BaseModel]]:
    return {v for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, BaseModel) and v is not BaseModel}


def _body_models() -> set[type[BaseModel]]:
    """Every model defined in multiserve.server.* or the supervisor's bodies, and every
    model either app documents as a request body."""
    models = _models_in(supervisor_bodies)
    for mod in pkgutil.iter_modules(server.__path__):
        models |= _models_in(importlib.import_module(f"multiserve.server.{mod.name}"))
    models |= {m for m in (*api_schema.BODIES.values(), *supervisor_openapi.BODIES.values())
               if isinstance(m, type) and issubclass(m, BaseModel)}
    return models


def _name(model: type[BaseModel]) -> str:
    return f"{model.__module__.removeprefix('multiserve.')}.{model.__qualname__}"


MODE_MODELS = sorted((m for m in _body_models() if "mode" in m.model_fields), key=_name)


def test_every_mode_field_is_found() -> None:
    assert {_name(m) for m in MODE_MODELS} == set(DEFAULTS)


@pytest.mark.parametrize("model", MODE_MODELS, ids=_name)
def test_mode_field_accepts_exactly_pause_modes(model: type[BaseModel]) -> None:
    field = model.model_fields["mode"]
    assert field.annotation == PauseMode
    assert field.default == DEFAULTS[_name(model)]
    prop = model.model_json_schema()["properties"]["mode"]
    assert prop["enum"] == list(PAUSE_MODES)
    for mode in PAUSE_MODES:
        assert model.model_validate({"mode": mode}).mode == mode  # type: ignore[attr-defined]
    for bad in ("later", "ABORT", "in-place", ""):
        with pytest.raises(ValidationError):
            model.model_validate({"mode": bad})


def test_asleep_reason_is_recognised() -> None:
    reason = asleep_reason({"kv_cache", "weights"})
    assert reason == f"{ASLEEP}: memory released (kv_cache, weights)" and is_asleep(reason)
    assert not is_asleep("ok")
