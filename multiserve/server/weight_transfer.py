"""vLLM's weight-transfer set-up call: what this JAX server can honour, and a 400 that says
why for what it cannot (never a silent accept).

  POST /init_weight_transfer_engine {"init_info": {...}}   (vLLM's WeightTransferInitRequest)
      init_info {} (vLLM's disk backend: nothing to set up) -> 200 {"message": "Weight
      transfer initialized", "backend": "disk"}; then /start_weight_update,
      /update_weights {"update_info": {"path": dir}}, /finish_weight_update
      {"weight_version"} (control_ops.py's session). init_info of vLLM's NCCL backend
      (master_address, master_port, rank_offset, world_size) or any other -> 400: a torch
      process group cannot be joined by this engine (it runs no torch).
SGLang's /init_weights_update_group, /update_weights_from_distributed and
/destroy_weights_update_group are control operations (control_ops.py; bodies in
control_bodies.py): backend "jax" joins a trainer's JAX transfer (engine/rl/transfer.py),
a torch backend is a 400 naming TORCH_BACKENDS and INSTEAD (below).

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
INSTEAD = ("update the weights with a JAX trainer's weight transfer "
           "(/init_weights_update_group with backend \"jax\", then "
           "/update_weights_from_distributed: multiserve/rl/jax_weight_sender.py), with "
           "/update_weights_from_disk {\"model_path\"} (every engine: the supervisor's), "
           "the session /start_weight_update, /update_weights "
           "{\"update_info\": {\"path\"}}, /finish_weight_update, or, in process, "
           "Engine.update_weights_from_arrays (a JAX trainer's arrays, device to device)")


class InitWeightTransferBody(BaseModel):
    """vLLM's WeightTransferInitRequest."""

    model_config = ConfigDict(extra="ignore", strict=True)
    init_info: dict[str, Any]


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

    app.add_api_route("/init_weight_transfer_engine", init_transfer, methods=["POST"])


BODIES = {("POST", "/init_weight_transfer_engine"): InitWeightTransferBody}
OPTIONAL: frozenset[tuple[str, str]] = frozenset()
