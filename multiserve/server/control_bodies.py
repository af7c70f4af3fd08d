"""The request bodies of the control routes: one pydantic model per operation's body.

Every control route (server/control_routes.py, and the supervisor's broadcast routes) parses
its body as the model `body_for(op)` names and turns it into the operation's keyword
arguments (`ControlBody.op_args`). A body is written here only where sglang's differs from
the operation's record (multiserve/control_ops.py): a different key (`model_path`,
`abort_all_requests`), a no-op value (the `cuda_graph` tag), an answer note; any other
operation's body is derived from its record (`derived_body`).

  POST /pause_generation           {"mode"?: "abort", "clear_cache"?: false}
  POST /abort_request              {"rid"} or {"abort_all": true}
  POST /release_memory_occupation  {"tags"?: [...], "mode"?: "retract", "preserve_state"?}
  POST /resume_memory_occupation   {"tags"?: [...]}
      tags: sglang's "weights", "kv_cache", "cuda_graph" (the last is a no-op here)
  POST /update_weights_from_disk   sglang's body: {"model_path", "weight_version"?,
                                    "abort_all_requests"?, "load_format"?, "flush_cache"?,
                                    ...} (see DiskBody); also {"path", "abort_running"}
  POST /stage_weights_from_disk    the same body  -> {"token", ...}
  POST /publish_staged_weights     {"token", "abort_running"?}
  POST /discard_staged_weights     {"token"?}
  GET|POST /get_weights_by_name    {"name", "truncate_size"?: 100} (GET: query params)
  POST /init_weights_update_group  SGLang's {master_address, master_port, rank_offset,
                                    world_size, group_name?, backend?}: backend "jax"
                                    joins a trainer's JAX transfer; torch backends 400
  POST /update_weights_from_distributed  SGLang's {names, dtypes, shapes, group_name?,
                                    weight_version?, abort_all_requests?, flush_cache?,
                                    ...} plus our `transfer_uuid` (see DistributedBody)
  POST /destroy_weights_update_group {group_name?}

Invariants: jax-free; a body's fields, types and defaults are defined once (the supervisor's
stricter spellings subclass these: fleet/supervisor_bodies.py).
"""

from __future__ import annotations

import dataclasses
import typing
import uuid
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from multiserve.control_ops import TRANSFER_BACKEND, ControlOp
from multiserve.server.errors import ApiError, bad_request
from multiserve.server.http_utils import parse_body
from multiserve.server.weight_transfer import INSTEAD, TORCH_BACKENDS
from multiserve.types import MEMORY_TAGS, ControlResult, PauseMode


class ControlBody(BaseModel):
    """A control route's body: strict types, unknown keys refused (400 naming the key).

    `optional_body`: an empty body means `{}` (else 400 "request body is empty").
    `op_args()`: the operation's keyword arguments (a bad combination raises the ApiError).
    `ready_answer()`: an answer given without the engine (nothing to do), or None.
    `answer(name, result)`: the engine's answer as the client gets it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    optional_body: ClassVar[bool] = False
    reads_query: ClassVar[bool] = False  # a GET spelling reads the fields from the query

    def op_args(self) -> dict[str, Any]:
        return self.model_dump()

    def ready_answer(self) -> ControlResult | None:
        return None

    def answer(self, name: str, result: ControlResult) -> ControlResult:
        return result

    @classmethod
    def from_query(cls, query: typing.Mapping[str, str]) -> ControlBody:
        """The body of a GET spelling of the route: empty, unless the body reads its query
        parameters (`reads_query`, overriding this; 400 on a bad one)."""
        return parse_body(cls, b"", allow_empty=True)


_Body = ControlBody


class _SglangBody(ControlBody):
    """A body sglang also accepts: keys we do not know are ignored, as sglang's own request
    structs ignore them (e.g. `rid`); keys we know are type-checked."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ---- /pause_generation and /abort_request (the supervisor's: fleet/supervisor_bodies.py) ---
class PauseBody(_SglangBody):
    optional_body: ClassVar[bool] = True
    mode: PauseMode = "abort"  # sglang's default for a pause (a release: "retract")
    clear_cache: bool = False  # vLLM's: drop unreferenced cached K/V once paused


class AbortBody(_SglangBody):
    rid: str | None = None
    abort_all: bool = False

    def op_args(self) -> dict[str, Any]:
        if self.rid is None and not self.abort_all:
            raise bad_request("give 'rid' or 'abort_all': true", param="rid")
        return {"rid": self.rid, "abort_all": self.abort_all}


# sglang's memory tags: the engine's (types.MEMORY_TAGS) plus "cuda_graph", memory this
# backend never holds (XLA keeps no CUDA graphs): releasing or resuming it is accepted and
# reported as a no-op.
NOOP_TAGS = ("cuda_graph",)


class _TagsBody(_SglangBody):
    optional_body: ClassVar[bool] = True
    verb: ClassVar[str]
    tags: list[str] | None = None

    @field_validator("tags")
    @classmethod
    def _known_tags(cls, tags: list[str] | None) -> list[str] | None:
        bad = [t for t in tags or () if t not in MEMORY_TAGS + NOOP_TAGS]
        if bad:
            raise ValueError(f"unknown tag {bad[0]!r}; known tags: {list(MEMORY_TAGS + NOOP_TAGS)}")
        return tags

    def split_tags(self) -> tuple[tuple[str, ...] | None, list[str]]:
        """(engine tags, no-op tags named). None = every tag (sglang's default for no
        tags); an EMPTY engine tuple means only no-op tags were named."""
        if not self.tags:
            return None, []
        return (tuple(t for t in self.tags if t in MEMORY_TAGS),
                [t for t in self.tags if t in NOOP_TAGS])

    def op_args(self) -> dict[str, Any]:
        return {**self.model_dump(), "tags": self.split_tags()[0]}

    def ready_answer(self) -> ControlResult | None:
        tags, noop = self.split_tags()
        return noop_tags_result(self.verb, noop) if tags == () else None

    def answer(self, name: str, result: ControlResult) -> ControlResult:
        return with_noop_tags(result, self.split_tags()[1])


class ReleaseBody(_TagsBody):
    verb: ClassVar[str] = "release"
    mode: PauseMode = "retract"  # sglang's default for a release (a pause: "abort")
    preserve_state: bool = False


class ResumeBody(_TagsBody):
    verb: ClassVar[str] = "resume"


def noop_tags_result(verb: str, noop: list[str]) -> ControlResult:
    return ControlResult(True, f"{verb} {noop}: nothing to do (no CUDA graphs here) (no-op)",
                         {"noop_tags": noop})


def with_noop_tags(result: ControlResult, noop: list[str]) -> ControlResult:
    if not noop:
        return result
    return ControlResult(result.ok, result.message, {**result.details, "noop_tags": noop})


LOAD_FORMATS = (None, "auto", "safetensors")  # an HF safetensors directory


class DiskBody(_SglangBody):
    """sglang's UpdateWeightFromDiskReqInput, plus our `path` / `abort_running` spellings.

    - weight_version: optional; absent, a new version string is made (`new_version`).
    - abort_all_requests (sglang) / abort_running (ours): abort live requests first.
    - flush_cache: the prefix cache is ALWAYS invalidated when weights change (its K/V was
      computed with the old weights); `false` is accepted and the answer says so.
    - load_format: only an HF safetensors directory (None, "auto", "safetensors").
    - keep_pause: an update never changes whether the engine is paused, so a paused
      engine stays paused (keep_pause=true is what happens); continue it with
      /continue_generation afterwards, as slime and AReaL do.
    - is_async, torch_empty_cache, recapture_cuda_graph, token_step: nothing to do here
      (the update is staged off the engine thread anyway; no torch, no CUDA graphs).
    - manifest (a partial tensor list) is refused: every tensor of the directory is read.
    - Unknown keys are ignored (AReaL once sent `abort_all_request`, a typo sglang ignores).
    """

    model_path: str | None = None
    path: str | None = None
    weight_version: str | None = None
    abort_running: bool = False
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True
    keep_pause: bool = False
    is_async: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None

    def dir(self) -> str:
        if (self.model_path is None) == (self.path is None):
            raise bad_request("give exactly one of 'model_path' or 'path'", param="model_path")
        if self.load_format not in LOAD_FORMATS:
            raise bad_request(f"load_format: {self.load_format!r} is not supported; an HF "
                              f"safetensors directory is read (load_format 'auto' or "
                              f"'safetensors')", param="load_format")
        if self.manifest:
            raise bad_request("manifest: not supported; every tensor of the directory is "
                              "read", param="manifest")
        return self.model_path if self.model_path is not None else self.path  # type: ignore

    @property
    def abort(self) -> bool:
        return self.abort_running or self.abort_all_requests

    def version(self) -> str:
        return self.weight_version or new_version(self.dir())

    def op_args(self) -> dict[str, Any]:
        return {"path": self.dir(), "weight_version": self.version(),
                "abort_running": self.abort}

    def answer(self, name: str, result: ControlResult) -> ControlResult:
        # only an update changes the weights (and so the prefix cache); a staging does not
        return self.note(result) if name == "update_weights_from_disk" else result

    def note(self, result: ControlResult) -> ControlResult:
        """The answer, saying when flush_cache=false could not be followed."""
        return flush_note(result, self.flush_cache)


def new_version(model_path: str) -> str:
    """A fresh weight version for an update that named none (sglang keeps the old name
    then; a new one lets clients tell the weights apart): the directory's name plus a
    unique suffix."""
    name = Path(model_path.rstrip("/")).name or "weights"
    return f"{name}-{uuid.uuid4().hex[:8]}"


class InitGroupBody(_SglangBody):
    """SGLang's InitWeightsUpdateGroupReqInput. backend "jax": master_address:master_port
    is the trainer's jax.experimental.transfer server (multiserve/rl/jax_weight_sender.py
    starts one); rank_offset and world_size are recorded only. Any torch backend (SGLang's
    default "nccl", gloo, ...) is a 400 that says why: a torch process group cannot be
    joined by this engine. AReaL sends master_port as a string."""

    master_address: str
    master_port: int | str
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = Field("nccl", description=(
        "\"jax\": join the JAX weight transfer of a trainer whose "
        "jax.experimental.transfer server listens at master_address:master_port; "
        "any torch backend (nccl, gloo, ...: SGLang's default nccl) is a 400"),
        examples=["jax"])

    def op_args(self) -> dict[str, Any]:
        if self.backend != TRANSFER_BACKEND:
            what = (f"a torch.distributed process group (backend {self.backend!r})"
                    if self.backend in TORCH_BACKENDS else f"backend {self.backend!r}")
            raise ApiError(400, f"init_weights_update_group: {what} cannot be joined by "
                           "this JAX engine (it runs no torch); " + INSTEAD,
                           param="backend", code="backend_unsupported")
        port = self.master_port
        if isinstance(port, str):
            if not port.strip().isdigit():
                raise bad_request("master_port: must be a port number", param="master_port")
            port = int(port)
        return {"master_address": self.master_address, "master_port": port,
                "group_name": self.group_name, "backend": self.backend,
                "rank_offset": self.rank_offset, "world_size": self.world_size}


class DistributedBody(_SglangBody):
    """SGLang's UpdateWeightsFromDistributedReqInput, for a group of backend "jax", plus
    one field of ours:
    - transfer_uuid (ours): the uuid the trainer offered the arrays under
      (TransferServer.await_pull(uuid, arrays), in the order of `names`); absent, it is
      derived from weight_version (control_ops.transfer_uuid_for); one of the two must be
      given. On the supervisor, engine i pulls transfer_uuid + i.
    - names (HF names), dtypes ("bfloat16" or "torch.bfloat16", ...), shapes: as offered;
      checked against the served model before any pull (400 naming the tensor); a subset
      of the model's tensors updates only those. Arrays are cast to the served dtype.
    - weight_version: the version published; absent, a new one is made.
    - abort_all_requests: abort live requests first (else the engine must be idle or
      paused). flush_cache: the prefix cache is ALWAYS invalidated (false is noted).
    - load_format must be null; torch_empty_cache is a no-op (no torch)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False
    transfer_uuid: int | None = Field(None, ge=0, lt=2**62, description=(
        "multiserve's extension: the uuid the trainer offered the arrays under "
        "(TransferServer.await_pull), in the order of names; absent, derived from "
        "weight_version (the first 7 bytes of sha256('multiserve-jax-transfer:' + "
        "weight_version)); on the supervisor engine i pulls transfer_uuid + i"))

    def version(self) -> str:
        if self.weight_version is None and self.transfer_uuid is None:
            raise bad_request("give transfer_uuid (the uuid the trainer offered the "
                              "arrays under) or weight_version (the uuid is then derived "
                              "from it)", param="transfer_uuid")
        if self.load_format is not None:
            raise bad_request(f"load_format: {self.load_format!r} is not supported (the "
                              "arrays arrive as they were offered)", param="load_format")
        return self.weight_version or new_version("distributed")

    def op_args(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes,
                "group_name": self.group_name, "transfer_uuid": self.transfer_uuid,
                "weight_version": self.version(), "abort_running": self.abort_all_requests}

    def answer(self, name: str, result: ControlResult) -> ControlResult:
        return flush_note(result, self.flush_cache)


class DestroyGroupBody(_SglangBody):
    """SGLang's DestroyWeightsUpdateGroupReqInput."""

    optional_body: ClassVar[bool] = True
    group_name: str = "weight_update_group"


def flush_note(result: ControlResult, flush_cache: bool) -> ControlResult:
    """The answer, saying when flush_cache=false could not be followed."""
    if flush_cache or not result.ok:
        return result
    return ControlResult(result.ok, result.message + "; the prefix cache was invalidated "
                         "anyway (flush_cache=false is not honoured: cached K/V belongs to "
                         "the old weights)", {**result.details, "flush_cache": True})


class TokenBody(_Body):
    token: str
    abort_running: bool = False


class DiscardBody(_Body):
    optional_body: ClassVar[bool] = True
    token: str | None = None


class WeightsByNameBody(_Body):
    reads_query: ClassVar[bool] = True
    name: str
    truncate_size: int = 100

    @classmethod
    def from_query(cls, query: typing.Mapping[str, str]) -> ControlBody:
        if "name" not in query:
            raise bad_request("name: required", param="name")
        try:
            return cls(name=query["name"], truncate_size=int(query.get("truncate_size", 100)))
        except ValueError:
            raise bad_request("truncate_size: must be an integer",
                              param="truncate_size") from None


# ---- which body each operation's route parses ---------------------------------------------
# None: the route reads no body (sglang's /continue_generation and /flush_cache take none).
# An operation with a route that is not listed takes the body derived from its record.
BODIES: dict[str, type[ControlBody] | None] = {
    "pause_generation": PauseBody,
    "continue_generation": None,
    "abort_request": AbortBody,
    "flush_cache": None,
    "release_memory_occupation": ReleaseBody,
    "resume_memory_occupation": ResumeBody,
    "update_weights_from_disk": DiskBody,
    "stage_weights_from_disk": DiskBody,
    "publish_staged_weights": TokenBody,
    "discard_staged_weights": DiscardBody,
    "get_weights_by_name": WeightsByNameBody,
    "init_weights_update_group": InitGroupBody,
    "update_weights_from_distributed": DistributedBody,
    "destroy_weights_update_group": DestroyGroupBody,
}


def derived_body(op: ControlOp) -> type[ControlBody]:
    """The body of an operation whose record's fields are its JSON keys: each field with its
    type and default (required without one); optional when every field has a default."""
    hints = typing.get_type_hints(op.request)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(op.request):
        default = f.default if f.default is not dataclasses.MISSING else ...
        fields[f.name] = (hints[f.name], default)
    model = create_model(f"{op.request.__name__}Body", __base__=ControlBody, **fields)
    model.optional_body = all(v[1] is not ... for v in fields.values())
    return model


def query_parameters(model: type[ControlBody]) -> list[dict[str, Any]]:
    """The OpenAPI query parameters of a GET spelling that reads its body's fields."""
    props = model.model_json_schema()["properties"]
    return [{"name": k, "in": "query", "required": f.is_required(),
             "schema": {"type": props[k].get("type", "string")}}
            for k, f in model.model_fields.items()]


def body_for(op: ControlOp) -> type[ControlBody] | None:
    return BODIES[op.name] if op.name in BODIES else derived_body(op)


