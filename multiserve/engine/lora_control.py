"""The LoRA control operations (multiserve/control_ops.py: load_lora_adapter,
unload_lora_adapter, list_lora_adapters) as ControlRunner operations.

Loading reads and checks the PEFT directory off the engine thread (`OffThread`), then one
`LoadLora` command puts the checked adapter into its slot between two steps. Every refusal
(`LoraRefused`) answers ok=False with the reason and its HTTP status (`http_status`: 400
an invalid adapter, 404 an unknown name, 409 a name already loaded, every slot taken, or
the adapter in use); nothing changes then.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from multiserve.config import ModelConfig
from multiserve.engine.commands import ListLoras, LoadLora, UnloadLora
from multiserve.engine.lora_adapters import LoraRefused, adapter_from_peft_dir
from multiserve.types import ControlResult

HTTP_STATUS = {"invalid": 400, "unknown": 404, "exists": 409, "full": 409, "in_use": 409}


def refusal(e: LoraRefused) -> ControlResult:
    return ControlResult(False, str(e), {"error": str(e), "error_kind": e.kind,
                                         "http_status": HTTP_STATUS[e.kind]})


class LoraOperations:
    """The LoRA operations of one engine (its model and max_lora_rank)."""

    def __init__(self, model_cfg: ModelConfig, max_rank: int) -> None:
        self.model_cfg = model_cfg
        self.max_rank = max_rank

    def load(self, name: str, path: str, off_thread: Any, inplace: bool = False
             ) -> Generator[Any, Any, ControlResult]:
        """`off_thread(fn)`: the ControlRunner's OffThread step; `inplace`: replace an
        adapter of that name (EngineCore.load_lora)."""
        try:
            adapter = yield off_thread(lambda: adapter_from_peft_dir(
                name, path, model_cfg=self.model_cfg, max_rank=self.max_rank))
            info = yield LoadLora(adapter, inplace)
        except LoraRefused as e:
            return refusal(e)
        listing = yield ListLoras()
        verb = "replaced" if info["replaced"] else "loaded"
        return ControlResult(True, f"{verb} LoRA adapter {name!r} (rank {info['rank']}) "
                             f"into slot {info['slot']}", {
                                 **info, "loaded_adapters": _loaded(listing)})

    @staticmethod
    def unload(name: str) -> Generator[Any, Any, ControlResult]:
        try:
            info = yield UnloadLora(name)
        except LoraRefused as e:
            return refusal(e)
        listing = yield ListLoras()
        return ControlResult(True, f"unloaded LoRA adapter {name!r}", {
            **info, "loaded_adapters": _loaded(listing)})

    @staticmethod
    def listing() -> Generator[Any, Any, ControlResult]:
        listing = yield ListLoras()
        return ControlResult(True, f"{len(listing)} LoRA adapter(s)", {"adapters": listing})


def _loaded(listing: list[dict[str, Any]]) -> dict[str, str]:
    """sglang's `loaded_adapters`: name -> source."""
    return {a["name"]: a["source"] for a in listing}
