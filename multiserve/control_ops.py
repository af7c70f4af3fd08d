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
FleetMerge = Literal["each", "sum_aborted", "two_phase", "session"]
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
