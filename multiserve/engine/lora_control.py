"""The LoRA control operations (multiserve/control_ops.py: load_lora_adapter,
load_lora_adapter_from_tensors, unload_lora_adapter, list_lora_adapters): the one path of
each, whoever calls (`Engine.control`, its one-line spellings, the HTTP routes, the
supervisor).

A load reads and checks the adapter (a PEFT directory, or PEFT-named tensors) off the
engine thread (`OffThread`), then one `InstallLora` command puts the checked adapter into
its slot between two steps (EngineCore.load_lora). Unload and list are one-step records:
the engine thread answers them here (`unload`, `listing`). Every refusal (`LoraRefused`)
answers ok=False with the reason, its kind and its HTTP status (`http_status`: 400 an
invalid adapter, 404 an unknown name, 409 a name already loaded, every slot taken, or the
adapter in use); nothing changes then.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from multiserve.config import ModelConfig
from multiserve.control_ops import LoadLoraAdapter, LoadLoraAdapterFromTensors
from multiserve.engine.base.lora_adapters import (
    LoraAdapter,
    LoraRefused,
    adapter_from_peft_dir,
    adapter_from_tensors,
)
from multiserve.engine.commands import InstallLora
from multiserve.types import ControlResult

if TYPE_CHECKING:
    from multiserve.engine.core import EngineCore

HTTP_STATUS = {"invalid": 400, "unknown": 404, "exists": 409, "full": 409, "in_use": 409}


def refusal(e: LoraRefused) -> ControlResult:
    return ControlResult(False, str(e), {"error": str(e), "error_kind": e.kind,
                                         "http_status": HTTP_STATUS[e.kind]})


class LoraOperations:
    """The LoRA load of one engine (its model and max_lora_rank)."""

    def __init__(self, model_cfg: ModelConfig, max_rank: int) -> None:
        self.model_cfg = model_cfg
        self.max_rank = max_rank

    def load(self, record: LoadLoraAdapter | LoadLoraAdapterFromTensors,
             off_thread: Callable[[Callable[[], Any]], Any]
             ) -> Generator[Any, Any, ControlResult]:
        """The operation of a load record; `off_thread(fn)`: the ControlRunner's OffThread
        step. `load_inplace`: replace an adapter of that name (EngineCore.load_lora)."""
        try:
            adapter = yield off_thread(lambda: self.adapter(record))
            info = yield InstallLora(adapter, record.load_inplace)
        except LoraRefused as e:
            return refusal(e)
        verb = "replaced" if info["replaced"] else "loaded"
        return ControlResult(True, f"{verb} LoRA adapter {record.lora_name!r} (rank "
                             f"{info['rank']}) into slot {info['slot']}", info)

    def adapter(self, record: LoadLoraAdapter | LoadLoraAdapterFromTensors) -> LoraAdapter:
        """The checked adapter a load record names (LoraRefused "invalid": why not)."""
        if isinstance(record, LoadLoraAdapter):
            return adapter_from_peft_dir(record.lora_name, record.lora_path,
                                         model_cfg=self.model_cfg, max_rank=self.max_rank)
        r = record.r
        return adapter_from_tensors(
            record.lora_name, record.tensors or {}, r=r,
            lora_alpha=float(r if record.lora_alpha is None else record.lora_alpha),
            use_rslora=record.use_rslora, target_modules=record.target_modules,
            model_cfg=self.model_cfg, max_rank=self.max_rank)


def install(core: EngineCore, adapter: LoraAdapter, replace: bool) -> dict[str, Any]:
    """The engine thread's step of a load: the adapter into its slot (LoraRefused: the
    name is loaded, or every slot is taken), and what is loaded now."""
    info = core.load_lora(adapter, replace)
    return {**info, "loaded_adapters": _loaded(core.loras.listing())}


def unload(core: EngineCore, name: str) -> ControlResult:
    """unload_lora_adapter, on the engine thread."""
    try:
        info = core.unload_lora(name)
    except LoraRefused as e:
        return refusal(e)
    return ControlResult(True, f"unloaded LoRA adapter {name!r}", {
        **info, "loaded_adapters": _loaded(core.loras.listing())})


def listing(core: EngineCore) -> ControlResult:
    """list_lora_adapters, on the engine thread."""
    adapters = core.loras.listing()
    return ControlResult(True, f"{len(adapters)} LoRA adapter(s)", {"adapters": adapters})


def _loaded(adapters: list[dict[str, Any]]) -> dict[str, str]:
    """sglang's `loaded_adapters`: name -> source."""
    return {a["name"]: a["source"] for a in adapters}
