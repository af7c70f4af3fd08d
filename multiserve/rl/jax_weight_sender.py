"""The trainer's side of the JAX weight transfer: offer new weights to a fleet's engines
over `jax.experimental.transfer` and ask them to pull, with SGLang's two calls.

    from multiserve.rl.jax_weight_sender import JaxWeightSender
    sender = JaxWeightSender("http://127.0.0.1:30010")  # the supervisor, or one engine
    sender.init_group()                                  # POST /init_weights_update_group
    sender.update({"model.embed_tokens.weight": w, ...}, weight_version="step-7")
                                                         # POST /update_weights_from_distributed
    sender.destroy_group(); sender.close()

`JaxWeightSender` starts a transfer server in the trainer's process (its first device's
client) at `host`:0 and tells the server where it is (master_address, master_port, backend
"jax"); the server's engines connect to it. `update` offers the tensors (flat {HF name:
array}, in that order; numpy or jax arrays, put on this process's first device as they
are: no cast) under `transfer_uuid` (default: derived from weight_version, as the server
derives it), once per pulling engine (the init answer's `pulls_per_update`: engine i of
the supervisor pulls transfer_uuid + i), then posts the names, dtypes and shapes; the
answer names the weight version the engines now serve. The arrays are held until pulled:
an update the server refuses (400: a name, shape or dtype the model does not have; the
engines keep their weights) leaves its offers unpulled.

Invariant: the body's names, dtypes and shapes are those of the offered arrays (the pull
trusts them: engine/rl/transfer.py). Imports jax; never imported by the server.
"""

from __future__ import annotations

import uuid as uuid_mod
from collections.abc import Mapping
from typing import Any

import httpx
import jax
import numpy as np

from multiserve.control_ops import MAX_TRANSFER_UUID, transfer_uuid_for


class TransferRefused(RuntimeError):
    """The server answered a call with an error status (its body attached)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


class JaxWeightSender:
    """See the module docstring. `url`: a supervisor's or an engine's base URL."""

    def __init__(self, url: str, *, host: str = "127.0.0.1",
                 group_name: str = "weight_update_group", api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        from jax.experimental import transfer

        self.url = url.rstrip("/")
        self.group_name = group_name
        self.device = jax.local_devices()[0]
        addr = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.server = transfer.start_transfer_server(self.device.client, addr, [addr])
        self.host = host
        self.port = int(self.server.address().rsplit(":", 1)[1])
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.pulls_per_update = 1

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(self.url + path, json=body)
        out = r.json()
        if r.status_code != 200:
            raise TransferRefused(r.status_code, out)
        return out

    def init_group(self) -> dict[str, Any]:
        """POST /init_weights_update_group (backend "jax"); the answer's
        pulls_per_update (1 on an engine, the engine count on a supervisor) is kept."""
        out = self._post("/init_weights_update_group", {
            "master_address": self.host, "master_port": self.port, "rank_offset": 1,
            "world_size": 2, "group_name": self.group_name, "backend": "jax"})
        self.pulls_per_update = int(out.get("pulls_per_update", 1))
        return out

    def offer(self, tensors: Mapping[str, Any], transfer_uuid: int) -> list[jax.Array]:
        """Offer `tensors` (in order) under transfer_uuid + i for each pulling engine i;
        the arrays as placed on this process's device."""
        arrays = [jax.device_put(x if isinstance(x, jax.Array) else np.asarray(x),
                                 self.device) for x in tensors.values()]
        for i in range(self.pulls_per_update):
            self.server.await_pull(transfer_uuid + i, arrays)
        return arrays

    def update(self, tensors: Mapping[str, Any], weight_version: str | None = None, *,
               transfer_uuid: int | None = None, abort_all_requests: bool = False,
               flush_cache: bool = True) -> dict[str, Any]:
        """Offer `tensors` and POST /update_weights_from_distributed; the answer (its
        weight_version is the one served now). TransferRefused on an error status."""
        if transfer_uuid is None:
            transfer_uuid = (transfer_uuid_for(weight_version) if weight_version is not None
                             else uuid_mod.uuid4().int % (MAX_TRANSFER_UUID // 2))
        arrays = self.offer(tensors, transfer_uuid)
        body: dict[str, Any] = {
            "names": list(tensors), "dtypes": [str(a.dtype) for a in arrays],
            "shapes": [list(a.shape) for a in arrays], "group_name": self.group_name,
            "transfer_uuid": transfer_uuid, "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._post("/update_weights_from_distributed", body)

    def destroy_group(self) -> dict[str, Any]:
        return self._post("/destroy_weights_update_group", {"group_name": self.group_name})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> JaxWeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
