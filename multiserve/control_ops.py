"""The control operations of an engine, each written once: the table every surface derives from.

One `ControlOp` row per operation names it, gives the record its arguments form (checked on
construction, so a bad argument is a ValueError at the call, on the caller's thread), how it
runs, its HTTP route and whether the fleet's supervisor broadcasts it. From the table:
- `Engine.control(name, **args)` / `await Engine.acontrol(name, **args)` (engine/engine.py)
  build the record and run it; the engine thread runs a one-step record through the one
  `match` of `Engine._dispatch` (or `ControlRunner.execute` for the RL group), and `ControlRunner`
  drives a staged one (weights read and copied off the engine thread, then commands);
- `EngineClient.acontrol` (types.py) is the whole control interface of the HTTP side, and
  the fleet's `EngineWorker.acontrol` its one forward (fleet/worker.py);
- each engine app's control routes (server/control_routes.py, bodies in
  server/control_bodies.py) and the supervisor's broadcast routes (fleet/supervisor.py),
  with their OpenAPI entries.
Adding an operation: its record and row here, and its case where the state it changes is
owned (docs/architecture.md §11).

Invariants: jax-free and below every side (imports only `multiserve.types`); a record holds
everything its operation needs; every operation answers a `ControlResult`, except
`get_internal_state` (a dict).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from multiserve.types import (
    HOLD_MODES,
    MEMORY_TAGS,
    MemoryTag,
    PauseMode,
    canonical_pause_mode,
    check_pause_mode,
)


def normalize_tags(tags: Any) -> tuple[MemoryTag, ...]:
    """Validated tags in MEMORY_TAGS order, the resume order (ValueError names the bad
    one). None/empty: all."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        tags = (tags,)
    tags = tuple(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"tags: unknown tag {bad[0]!r}; known tags: {list(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags) or MEMORY_TAGS


# ---- the records: one per operation (one-step ones are the engine thread's commands) -------
@dataclass(frozen=True)
class PauseGeneration:
    """The user's pause: drain, then abort / retract / keep (in_place) running requests,
    or (wait) close admission, let the requests live now finish, then pause.
    `clear_cache` (vLLM's): after abort, retract or wait, drop the cached K/V no request
    holds (keep/in_place: ignored, as vLLM ignores it)."""
    mode: PauseMode = "abort"
    clear_cache: bool = False

    def __post_init__(self) -> None:
        check_pause_mode(self.mode)
        object.__setattr__(self, "mode", canonical_pause_mode(self.mode))
        object.__setattr__(self, "clear_cache", bool(self.clear_cache))


@dataclass(frozen=True)
class ContinueGeneration:
    """Clear the user's pause (holds stay)."""


@dataclass(frozen=True)
class AbortRequest:
    """End one request (`rid`) or every live one (`abort_all`) with finish_reason abort."""
    rid: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class FlushCache:
    """Reset the prefix cache and the allocator when nothing is live."""


@dataclass(frozen=True)
class GetInternalState:
    """The engine's internal state (engine/state_report.internal_state)."""


@dataclass(frozen=True)
class PublishStagedWeights:
    """Swap staged weights `token` in, set their version, invalidate the prefix cache."""
    token: str
    abort_running: bool = False


@dataclass(frozen=True)
class DiscardStagedWeights:
    """Drop staged weights (`token`, or whichever are staged) and end their hold."""
    token: str | None = None


@dataclass(frozen=True)
class GetWeightsByName:
    """One tensor's first `truncate_size` rows (HF name and orientation)."""
    name: str
    truncate_size: int = 100

    def __post_init__(self) -> None:
        if self.truncate_size < 1:
            raise ValueError("truncate_size: must be >= 1")


@dataclass(frozen=True)
class ReleaseMemoryOccupation:
    """Hold the engine (applying `mode` if it runs), then free the tagged device buffers."""
    tags: Any = MEMORY_TAGS  # normalized on construction: a tuple of MemoryTag
    mode: PauseMode = "retract"
    preserve_state: bool = False

    def __post_init__(self) -> None:
        check_pause_mode(self.mode, HOLD_MODES)
        object.__setattr__(self, "mode", canonical_pause_mode(self.mode))
        object.__setattr__(self, "tags", normalize_tags(self.tags))
        object.__setattr__(self, "preserve_state", bool(self.preserve_state))


@dataclass(frozen=True)
class ResumeMemoryOccupation:
    """Bring the tagged device buffers back; the hold ends once all are resident."""
    tags: Any = MEMORY_TAGS  # normalized on construction

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", normalize_tags(self.tags))


@dataclass(frozen=True, eq=False)
class StageWeightsFromTensor:
    """Validate + copy `params` (flat {HF name: array}, (name, array) pairs, or the params
    pytree; a subset updates only those tensors) onto the devices; held until publish."""
    params: Any
    weight_version: str
    abort_running: bool = False


@dataclass(frozen=True)
class StageWeightsFromDisk:
    """Like StageWeightsFromTensor, every tensor of an HF safetensors directory."""
    path: str
    weight_version: str
    abort_running: bool = False


@dataclass(frozen=True, eq=False)
class UpdateWeightsFromTensor:
    """StageWeightsFromTensor, then PublishStagedWeights."""
    params: Any
    weight_version: str
    abort_running: bool = False


@dataclass(frozen=True, eq=False)
class UpdateWeightsFromArrays:
    """UpdateWeightsFromTensor for in-process device arrays (flat {HF name: jax.Array},
    pairs, or the params pytree): each must be a jax.Array of exactly the served dtype; it
    is resharded device to device onto the engine's shardings (no host copy, no cast) and
    no value is read back (NaN/inf are not checked). Python API only."""
    params: Any
    weight_version: str
    abort_running: bool = False


@dataclass(frozen=True)
class UpdateWeightsFromDisk:
    """StageWeightsFromDisk, then PublishStagedWeights."""
    path: str
    weight_version: str
    abort_running: bool = False


@dataclass(frozen=True)
class StartWeightUpdate:
    """Open a weight-update session (vLLM's /start_weight_update; tpu-inference's
    start_weight_update, whose default frees the KV cache: Engine.start_weight_update):
    hold the engine for one update (engine/rl/session.py); with `free_kv_cache`, release
    the KV pool until the session ends (requests holding K/V re-prefill with the new
    weights)."""
    free_kv_cache: bool = False
    abort_running: bool = False


# the keys of vLLM's NCCL and CUDA-IPC backends' update_info: torch tensors moved by NCCL
# or by CUDA IPC handles, which never reach a JAX engine
TORCH_UPDATE_KEYS = ("names", "dtype_names", "shapes", "packed", "sizes", "ipc_handles")


@dataclass(frozen=True, eq=False)
class UpdateWeights:
    """Stage one checkpoint into the open session (vLLM's /update_weights and its
    `update_info`): {"path": an absolute HF safetensors directory} (vLLM's disk backend:
    every tensor), or, in process, {"params": tensors} (a subset updates only those);
    finish_weight_update publishes it."""
    update_info: Any

    def __post_init__(self) -> None:
        info = self.update_info
        if not isinstance(info, dict):
            raise ValueError("update_info: must be an object")
        if any(k in info for k in TORCH_UPDATE_KEYS):
            raise ValueError("update_info: torch tensors sent by NCCL broadcast or CUDA IPC "
                             "(names, dtype_names, shapes, ...) cannot reach this JAX "
                             "engine; give {\"path\": an HF safetensors directory} "
                             "(vLLM's disk backend)")
        if ("path" in info) == ("params" in info) or set(info) - {"path", "params"}:
            raise ValueError("update_info: give exactly one of 'path' (a directory) or "
                             "'params' (tensors, in process), and nothing else")
        path = info.get("path")
        if "path" in info and not (isinstance(path, str) and path.startswith("/")):
            raise ValueError("update_info.path: must be an absolute directory path")


@dataclass(frozen=True)
class FinishWeightUpdate:
    """Publish what the open session staged as `weight_version` (None: a new version
    named after its source), bring back what start freed, close the session."""
    weight_version: str | None = None

    def __post_init__(self) -> None:
        if self.weight_version is not None and (not isinstance(self.weight_version, str)
                                                or not self.weight_version):
            raise ValueError("weight_version: must be a non-empty string or null")


@dataclass(frozen=True)
class AbortWeightUpdate:
    """Close the open session without changing the weights (discard, bring back what
    start freed)."""


# ---- JAX-to-JAX weight transfer (SGLang's init_weights_update_group /
# update_weights_from_distributed with backend "jax": engine/rl/transfer.py) ------------------
# the dtypes a transfer may name (SGLang clients send str(torch.dtype): "torch.bfloat16")
TRANSFER_DTYPES = ("float32", "bfloat16", "float16", "float64")
TRANSFER_BACKEND = "jax"
MAX_TRANSFER_UUID = 2**62  # uuids (and an engine's offset added by the supervisor) stay below


def transfer_dtype(name: str) -> str:
    """A dtype name as the transfer reads it ("torch.bfloat16" -> "bfloat16"); ValueError
    for any other than TRANSFER_DTYPES."""
    short = name.removeprefix("torch.") if isinstance(name, str) else name
    if short not in TRANSFER_DTYPES:
        raise ValueError(f"dtypes: {name!r} is not a floating-point dtype a weight transfer "
                         f"carries ({list(TRANSFER_DTYPES)}, or torch.<name>)")
    return short


def transfer_uuid_for(weight_version: str) -> int:
    """The transfer uuid of an update that names none: derived from its weight_version
    (the first 7 bytes of sha256("multiserve-jax-transfer:" + version)), so a trainer that
    offers under `transfer_uuid_for(version)` need not send the uuid."""
    import hashlib

    digest = hashlib.sha256(f"multiserve-jax-transfer:{weight_version}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


@dataclass(frozen=True)
class InitWeightsUpdateGroup:
    """Join the JAX weight transfer of a trainer whose transfer server
    (jax.experimental.transfer) listens at master_address:master_port, as group
    `group_name`: the engine starts its own transfer server and opens a connection
    (jax connects lazily: the first pull reaches the trainer). SGLang's rank_offset and
    world_size are recorded only (a pull needs no ranks)."""
    master_address: str
    master_port: int
    group_name: str = "weight_update_group"
    backend: str = TRANSFER_BACKEND
    rank_offset: int = 1
    world_size: int = 2

    def __post_init__(self) -> None:
        if self.backend != TRANSFER_BACKEND:
            raise ValueError(f"backend: {self.backend!r}; this engine joins only a JAX "
                             f"transfer (backend {TRANSFER_BACKEND!r})")
        if not isinstance(self.master_address, str) or not self.master_address.strip():
            raise ValueError("master_address: must be a host name or address")
        if any(c in self.master_address for c in " /"):
            raise ValueError("master_address: must be a host name or address (no port, "
                             "no scheme)")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 0 < self.master_port < 65536:
            raise ValueError("master_port: must be a port number in [1, 65535]")
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError("group_name: must be a non-empty string")


@dataclass(frozen=True, eq=False)
class StageWeightsFromDistributed:
    """Pull tensors `names` (HF names; `dtypes`, `shapes` as the trainer offered them)
    from group `group_name`'s trainer under `transfer_uuid` (None: transfer_uuid_for(
    weight_version)), check them against the served model (before any byte moves) and
    stage them like update_weights_from_tensor's (cast to the served dtype, a subset
    updates only those tensors); held until publish."""
    names: Any
    dtypes: Any
    shapes: Any
    weight_version: str
    group_name: str = "weight_update_group"
    transfer_uuid: int | None = None
    abort_running: bool = False

    def __post_init__(self) -> None:
        names, dtypes, shapes = self.names, self.dtypes, self.shapes
        if not isinstance(names, (list, tuple)) or not names:
            raise ValueError("names: must be a non-empty list of tensor names")
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError("names: each must be a non-empty string")
        if len(set(names)) != len(names):
            raise ValueError("names: a tensor is named twice")
        if not isinstance(dtypes, (list, tuple)) or len(dtypes) != len(names):
            raise ValueError(f"dtypes: must list one dtype per name ({len(names)})")
        if not isinstance(shapes, (list, tuple)) or len(shapes) != len(names):
            raise ValueError(f"shapes: must list one shape per name ({len(names)})")
        for s in shapes:
            if not isinstance(s, (list, tuple)) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s):
                raise ValueError("shapes: each must be a list of non-negative integers")
        if not isinstance(self.weight_version, str) or not self.weight_version:
            raise ValueError("weight_version: must be a non-empty string")
        uid = self.transfer_uuid
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int)
                                or not 0 <= uid < MAX_TRANSFER_UUID):
            raise ValueError("transfer_uuid: must be an integer in [0, 2**62)")
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "dtypes", tuple(transfer_dtype(d) for d in dtypes))
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in shapes))
        if uid is None:
            object.__setattr__(self, "transfer_uuid", transfer_uuid_for(self.weight_version))


@dataclass(frozen=True, eq=False)
class UpdateWeightsFromDistributed(StageWeightsFromDistributed):
    """StageWeightsFromDistributed, then PublishStagedWeights."""


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup:
    """Close group `group_name`'s connection (no group of that name: a no-op)."""
    group_name: str = "weight_update_group"


@dataclass(frozen=True)
class LoadLoraAdapter:
    """Load the PEFT adapter directory `lora_path` into a free LoRA slot as `lora_name`
    (engine/base/lora_adapters.py: read and checked off the engine thread, then one command);
    `load_inplace` (sglang's): replace an adapter of that name already loaded, live
    requests finishing on the version they were admitted with (EngineCore.load_lora)."""
    lora_name: str
    lora_path: str
    load_inplace: bool = False


@dataclass(frozen=True, eq=False)
class LoadLoraAdapterFromTensors:
    """LoadLoraAdapter from PEFT-named in-memory tensors (`lora_A.weight` [r, in],
    `lora_B.weight` [out, r] per target module) of rank `r`, scaled by `lora_alpha`
    (default r) over r (or its square root: `use_rslora`). Python API only."""
    lora_name: str
    tensors: Any
    r: int
    lora_alpha: float | None = None
    use_rslora: bool = False
    target_modules: Any = None
    load_inplace: bool = False


@dataclass(frozen=True)
class UnloadLoraAdapter:
    """Free adapter `lora_name`'s slot (refused while live requests use it)."""
    lora_name: str


@dataclass(frozen=True)
class ListLoraAdapters:
    """The loaded LoRA adapters (details["adapters"]: name, slot, rank, scale,
    target_modules, source)."""


# ---- the table ----------------------------------------------------------------------------
# How the supervisor answers a broadcast: "each" (every engine's answer, 200 iff all
# succeeded), "sum_aborted" (that, plus the engines' `aborted` summed), "two_phase" (stage
# on all, then publish on all or discard on all: fleet/supervisor_rl.py), "session" (a
# weight-update session's step on every engine, all or none: fleet/supervisor_weights.py).
# "transfer": the JAX weight transfer's group calls (fleet/supervisor_rl.py: init on all or
# none, the update two-phase as from disk, destroy on every engine).
FleetMerge = Literal["each", "sum_aborted", "two_phase", "session", "transfer"]
Group = Literal["core", "rl"]  # core: build_app / build_supervisor_app; rl: add_rl_*routes


@dataclass(frozen=True)
class Route:
    path: str
    methods: tuple[str, ...] = ("POST",)
    aliases: tuple[str, ...] = ()  # more paths of the same route (another API's spelling)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, *self.aliases)


@dataclass(frozen=True)
class ControlOp:
    name: str  # Engine.control's name, the route's name (its path without "/")
    request: type  # the record its arguments form
    group: Group
    # one_step: the record is one command for the engine thread; staged: ControlRunner reads and
    # copies weights off the engine thread between the commands it sends
    runs: Literal["one_step", "staged"] = "one_step"
    route: Route | None = None  # None: Python API only
    # HTTP status of an answer with success false: 400 (with the error object), or 200 where
    # sglang reports the outcome in the body only (pause, continue, abort)
    refused_status: int = 400
    fleet: FleetMerge | None = None  # None: the supervisor does not offer it

    def arguments(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.request))


def _post(path: str, *methods: str) -> Route:
    return Route(path, methods or ("POST",))


OPS: dict[str, ControlOp] = {op.name: op for op in (
    ControlOp("pause_generation", PauseGeneration, "core", route=_post("/pause_generation"),
              refused_status=200, fleet="each"),
    ControlOp("continue_generation", ContinueGeneration, "core",
              route=_post("/continue_generation"), refused_status=200, fleet="each"),
    ControlOp("abort_request", AbortRequest, "core", route=_post("/abort_request"),
              refused_status=200, fleet="sum_aborted"),
    ControlOp("flush_cache", FlushCache, "core", route=_post("/flush_cache", "GET", "POST"),
              fleet="each"),
    ControlOp("get_internal_state", GetInternalState, "core"),  # read by the info routes
    # LoRA adapters: sglang's paths, vLLM's as aliases; a refusal's status is the
    # answer's own (`http_status`: 400 invalid, 404 unknown, 409 slots full / in use)
    # (a load reads and checks the adapter off the engine thread: engine/lora_control.py)
    ControlOp("load_lora_adapter", LoadLoraAdapter, "core", runs="staged",
              route=Route("/load_lora_adapter", ("POST",), ("/v1/load_lora_adapter",))),
    ControlOp("load_lora_adapter_from_tensors", LoadLoraAdapterFromTensors, "core",
              runs="staged"),
    ControlOp("unload_lora_adapter", UnloadLoraAdapter, "core",
              route=Route("/unload_lora_adapter", ("POST",), ("/v1/unload_lora_adapter",))),
    ControlOp("list_lora_adapters", ListLoraAdapters, "core"),  # read by /v1/models
    ControlOp("release_memory_occupation", ReleaseMemoryOccupation, "rl",
              route=_post("/release_memory_occupation"), fleet="each"),
    ControlOp("resume_memory_occupation", ResumeMemoryOccupation, "rl",
              route=_post("/resume_memory_occupation"), fleet="each"),
    ControlOp("update_weights_from_disk", UpdateWeightsFromDisk, "rl", runs="staged",
              route=_post("/update_weights_from_disk"), fleet="two_phase"),
    ControlOp("stage_weights_from_disk", StageWeightsFromDisk, "rl", runs="staged",
              route=_post("/stage_weights_from_disk")),
    ControlOp("publish_staged_weights", PublishStagedWeights, "rl",
              route=_post("/publish_staged_weights")),
    ControlOp("discard_staged_weights", DiscardStagedWeights, "rl",
              route=_post("/discard_staged_weights")),
    ControlOp("get_weights_by_name", GetWeightsByName, "rl",
              route=_post("/get_weights_by_name", "GET", "POST"), fleet="each"),
    # the weight-update session (engine/rl/session.py): vLLM's routes, tpu-inference's names
    ControlOp("start_weight_update", StartWeightUpdate, "rl",
              route=_post("/start_weight_update"), fleet="session"),
    ControlOp("update_weights", UpdateWeights, "rl", runs="staged",
              route=_post("/update_weights"), fleet="session"),
    ControlOp("finish_weight_update", FinishWeightUpdate, "rl",
              route=_post("/finish_weight_update"), fleet="session"),
    ControlOp("abort_weight_update", AbortWeightUpdate, "rl",
              route=_post("/abort_weight_update"), fleet="each"),
    # SGLang's weights-update group, with backend "jax": a JAX-to-JAX transfer
    # (engine/rl/transfer.py); torch backends are the body's 400 (control_bodies.py)
    ControlOp("init_weights_update_group", InitWeightsUpdateGroup, "rl", runs="staged",
              route=_post("/init_weights_update_group"), fleet="transfer"),
    ControlOp("update_weights_from_distributed", UpdateWeightsFromDistributed, "rl",
              runs="staged", route=_post("/update_weights_from_distributed"),
              fleet="transfer"),
    ControlOp("stage_weights_from_distributed", StageWeightsFromDistributed, "rl",
              runs="staged"),
    ControlOp("destroy_weights_update_group", DestroyWeightsUpdateGroup, "rl", runs="staged",
              route=_post("/destroy_weights_update_group"), fleet="transfer"),
    ControlOp("update_weights_from_tensor", UpdateWeightsFromTensor, "rl", runs="staged"),
    ControlOp("stage_weights_from_tensor", StageWeightsFromTensor, "rl", runs="staged"),
    ControlOp("update_weights_from_arrays", UpdateWeightsFromArrays, "rl", runs="staged"),
)}
STAGED = tuple(op.request for op in OPS.values() if op.runs == "staged")


def control_request(name: str, /, **args: Any) -> Any:
    """The record of operation `name` with `args` (ValueError: unknown operation or a bad
    argument; TypeError: an argument the operation does not take)."""
    op = OPS.get(name)
    if op is None:
        raise ValueError(f"unknown control operation {name!r}; known: {sorted(OPS)}")
    return op.request(**args)
