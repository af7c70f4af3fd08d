"""The weight-transfer set-up calls of vLLM and SGLang: what this JAX server can honour,
and a 400 that says why for what it cannot (never a silent accept).

  POST /init_weight_transfer_engine {"init_info": {...}}   (vLLM's WeightTransferInitRequest)
      init_info {} (vLLM's disk backend: nothing to set up) -> 200 {"message": "Weight
      transfer initialized", "backend": "disk"}; then /start_weight_update,
      /update_weights {"update_info": {"path": dir}}, /finish_weight_update
      {"weight_version"} (control_ops.py's session). init_info of vLLM's NCCL backend
      (master_address, master_port, rank_offset, world_size) or any other -> 400: a torch
      process group cannot be joined by this engine (it runs no torch).
  POST /init_weights_update_group  SGLang's {master_address, master_port, rank_offset,
      world_size, group_name?, backend?} -> 400 for every torch backend (nccl, gloo, ...).
  POST /update_weights_from_distributed  SGLang's {names, dtypes, shapes, group_name?, ...}
      -> 400: no weights update group exists here (none can be initialised).
  POST /destroy_weights_update_group {group_name?} -> 200, nothing to destroy (no-op).
The 400s name what to use instead: /update_weights_from_disk, the disk session, or, in
process, Engine.update_weights_from_arrays (a JAX trainer's arrays, device to device).

Invariants: jax-free and stateless (no engine is asked: the answer depends on the body
only), so the engine apps and the supervisor answer the same; bodies are strict about
types.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.server.errors import ApiError
from multiserve.server.http_utils import parse_body

# vLLM's NCCL backend's init_info (NCCLWeightTransferInitInfo); SGLang's torch backends
NCCL_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size")
TORCH_BACKENDS = ("nccl", "gloo", "hccl", "xccl", "mccl", "mpi")
INSTEAD = ("update the weights with /update_weights_from_disk {\"model_path\"} (every "
           "engine: the supervisor's), the session /start_weight_update, /update_weights "
           "{\"update_info\": {\"path\"}}, /finish_weight_update, or, in process, "
           "Engine.update_weights_from_arrays (a JAX trainer's arrays, device to device)")


class InitWeightTransferBody(BaseModel):
    """vLLM's WeightTransferInitRequest."""

    model_config = ConfigDict(extra="ignore", strict=True)
    init_info: dict[str, Any]


class InitWeightsUpdateGroupBody(BaseModel):
    """SGLang's InitWeightsUpdateGroupReqInput (AReaL sends master_port as a string)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    master_address: str
    master_port: int | str
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdateBody(BaseModel):
    """SGLang's UpdateWeightsFromDistributedReqInput (slime's, AReaL's)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyGroupBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_name: str = "weight_update_group"


def init_transfer_answer(body: InitWeightTransferBody) -> dict[str, Any]:
    info = body.init_info
    if any(k in info for k in NCCL_INIT_KEYS):
        raise ApiError(400, "init_info: vLLM's NCCL backend joins a torch process group, "
                       "which this JAX engine cannot join (it runs no torch); " + INSTEAD,
                       param="init_info", code="backend_unsupported")
    if info:
        raise ApiError(400, f"init_info: keys {sorted(info)} are no backend this server "
                       "has; its backend is vLLM's disk one (init_info {}, then "
                       "update_info {\"path\": an HF safetensors directory})",
                       param="init_info", code="backend_unsupported")
    return {"success": True, "message": "Weight transfer initialized", "backend": "disk"}


def add_weight_transfer_routes(app: FastAPI) -> None:
    async def init_transfer(request: Request) -> Response:
        body = parse_body(InitWeightTransferBody, await request.body())
        return JSONResponse(init_transfer_answer(body))

    async def init_group(request: Request) -> Response:
        body = parse_body(InitWeightsUpdateGroupBody, await request.body())
        what = (f"a torch.distributed process group (backend {body.backend!r})"
                if body.backend in TORCH_BACKENDS else f"backend {body.backend!r}")
        raise ApiError(400, f"init_weights_update_group: {what} cannot be joined by this "
                       "JAX engine (it runs no torch); " + INSTEAD, param="backend",
                       code="backend_unsupported")

    async def from_distributed(request: Request) -> Response:
        body = parse_body(DistributedUpdateBody, await request.body())
        raise ApiError(400, f"update_weights_from_distributed: no weights update group "
                       f"{body.group_name!r} exists here (none can be initialised: see "
                       "/init_weights_update_group); " + INSTEAD, param="group_name",
                       code="no_update_group")

    async def destroy_group(request: Request) -> Response:
        body = parse_body(DestroyGroupBody, await request.body(), allow_empty=True)
        return JSONResponse({"success": True, "message": f"no weights update group "
                             f"{body.group_name!r} exists (no-op)"})

    app.add_api_route("/init_weight_transfer_engine", init_transfer, methods=["POST"])
    app.add_api_route("/init_weights_update_group", init_group, methods=["POST"])
    app.add_api_route("/update_weights_from_distributed", from_distributed, methods=["POST"])
    app.add_api_route("/destroy_weights_update_group", destroy_group, methods=["POST"])


BODIES = {("POST", "/init_weight_transfer_engine"): InitWeightTransferBody,
          ("POST", "/init_weights_update_group"): InitWeightsUpdateGroupBody,
          ("POST", "/update_weights_from_distributed"): DistributedUpdateBody,
          ("POST", "/destroy_weights_update_group"): DestroyGroupBody}
OPTIONAL = frozenset({("POST", "/destroy_weights_update_group")})
