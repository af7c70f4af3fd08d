"""LoRA adapters on the host (no jax): parsing, checking, and the engine's slot table.

An adapter arrives as PEFT tensors (an `adapter_config.json` + `adapter_model.safetensors`
directory, or in memory: a name -> array dict with its r, lora_alpha, use_rslora) and is
checked against the served model and the engine's `max_lora_rank` before anything is
written: every refusal (`LoraRefused`) leaves the engine's adapters as they were. A
checked adapter (`LoraAdapter`) holds its matrices already in the device buffers' layout
(model/lora_layout.py), zero-padded to max_lora_rank, so the runner only copies it into
its slot.

`LoraTable` maps adapter names to slots 1..max_loras_per_batch (slot 0: no adapter); only
the engine thread reads or changes it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.lora_layout import LORA_MODULES, module_shapes

# PEFT's tensor names: [base_model.model.]model.layers.<i>.<block>.<module>.lora_<A|B>
# [.<adapter>].weight
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                   r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_BY_PEFT = {peft: ours for ours, peft in LORA_MODULES.items()}


class LoraRefused(ValueError):
    """A LoRA operation refused, nothing changed. `kind`: "invalid" (bad adapter or
    arguments), "unknown" (no adapter of that name), "exists" (the name is loaded),
    "full" (every slot holds an adapter), "in_use" (live requests use it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: `buffers` maps each buffer key of model/lora_layout.py but
    `scale` (`<m>_a` [L, K, max_rank], `<m>_b` [L, max_rank, N], float32; zeros where
    the adapter has no module or rank) to this adapter's slice of it."""

    name: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]  # PEFT names
    buffers: dict[str, np.ndarray]
    source: str  # the directory it came from, or "tensors"


def adapter_from_tensors(name: str, tensors: Mapping[str, Any], *, r: int,
                         lora_alpha: float, use_rslora: bool = False,
                         target_modules: Any = None, model_cfg: ModelConfig,
                         max_rank: int, source: str = "tensors") -> LoraAdapter:
    """Check PEFT-named tensors (`lora_A.weight` [r, in], `lora_B.weight` [out, r]) and
    lay them out for the device (LoraRefused("invalid", reason) on any mismatch)."""
    if not name or not isinstance(name, str):
        raise LoraRefused("invalid", "lora_name: must be a non-empty string")
    if not isinstance(r, int) or r < 1:
        raise LoraRefused("invalid", f"r: must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraRefused("invalid", f"adapter {name!r}: rank r={r} exceeds the engine's "
                          f"max_lora_rank ({max_rank})")
    targets = _targets(name, target_modules)
    shapes = module_shapes(model_cfg)
    layers = model_cfg.num_layers
    buffers = {}
    for ours, (k, n) in shapes.items():
        buffers[f"{ours}_a"] = np.zeros((layers, k, max_rank), np.float32)
        buffers[f"{ours}_b"] = np.zeros((layers, max_rank, n), np.float32)
    seen: set[tuple[int, str, str]] = set()
    for key, value in tensors.items():
        m = _NAME.match(key)
        if m is None:
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r} is not a LoRA "
                              "A/B weight of a decoder layer's projection (unsupported "
                              "target module or name)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in _BY_PEFT or module not in targets:
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r} targets module "
                              f"{module!r}: supported are {sorted(_BY_PEFT)} (and it must "
                              "be in target_modules)")
        if layer >= layers:
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r}: the model has "
                              f"{layers} layers")
        ours = _BY_PEFT[module]
        k, n = shapes[ours]
        a = np.asarray(value)
        want = (r, k) if which == "A" else (n, r)
        if a.shape != want:
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r} has shape "
                              f"{list(a.shape)}, expected {list(want)} (r={r})")
        if not np.issubdtype(a.dtype, np.floating):
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r} has dtype "
                              f"{a.dtype}, expected a floating type")
        if (layer, module, which) in seen:
            raise LoraRefused("invalid", f"adapter {name!r}: tensor {key!r} repeats a "
                              "weight")
        seen.add((layer, module, which))
        if which == "A":
            buffers[f"{ours}_a"][layer, :, :r] = a.astype(np.float32).T
        else:
            buffers[f"{ours}_b"][layer, :r, :] = a.astype(np.float32).T
    for layer, module, which in seen:
        other = "B" if which == "A" else "A"
        if (layer, module, other) not in seen:
            raise LoraRefused("invalid", f"adapter {name!r}: layer {layer} {module} has "
                              f"lora_{which} but no lora_{other}")
    if not seen:
        raise LoraRefused("invalid", f"adapter {name!r}: no LoRA tensors")
    scale = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
    return LoraAdapter(name, r, float(scale), tuple(sorted(targets)), buffers, source)


def _targets(name: str, target_modules: Any) -> set[str]:
    """PEFT's target_modules as a set of module names (None / "all-linear": all)."""
    if target_modules is None or target_modules == "all-linear":
        return set(_BY_PEFT)
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if not isinstance(target_modules, (list, tuple)) or not all(
            isinstance(t, str) for t in target_modules):
        raise LoraRefused("invalid", f"adapter {name!r}: target_modules must be a list of "
                          "module names")
    bad = sorted(set(target_modules) - set(_BY_PEFT))
    if bad:
        raise LoraRefused("invalid", f"adapter {name!r}: unsupported target modules {bad}; "
                          f"supported: {sorted(_BY_PEFT)}")
    return set(target_modules)


def adapter_from_peft_dir(name: str, path: str, *, model_cfg: ModelConfig,
                          max_rank: int) -> LoraAdapter:
    """A PEFT adapter directory: adapter_config.json (r, lora_alpha, use_rslora,
    target_modules) and adapter_model.safetensors."""
    from multiserve.model.loading import safetensors_io

    root = Path(path)
    config_file, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise LoraRefused("invalid", f"lora_path {path!r}: needs adapter_config.json and "
                          "adapter_model.safetensors (a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraRefused("invalid", f"lora_path {path!r}: adapter_config.json: {exc}") from exc
    if config.get("use_dora"):
        raise LoraRefused("invalid", f"adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraRefused("invalid", f"adapter {name!r}: rank_pattern / alpha_pattern are "
                          "not supported (one r and lora_alpha for every module)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoraRefused("invalid", f"adapter {name!r}: LoRA biases are not supported")
    if config.get("modules_to_save"):
        raise LoraRefused("invalid", f"adapter {name!r}: modules_to_save is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(alpha, (int, float)):
        raise LoraRefused("invalid", f"adapter {name!r}: lora_alpha must be a number")
    try:
        tensors = safetensors_io.load_file(weights)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a refusal
        raise LoraRefused("invalid", f"lora_path {path!r}: adapter_model.safetensors: "
                          f"{exc}") from exc
    return adapter_from_tensors(name, tensors, r=r, lora_alpha=float(alpha),
                                use_rslora=bool(config.get("use_rslora", False)),
                                target_modules=config.get("target_modules"),
                                model_cfg=model_cfg, max_rank=max_rank, source=str(root))


class LoraTable:
    """Adapter name -> slot (1..capacity). Engine thread only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: dict[str, int] = {}
        self.adapters: dict[str, LoraAdapter] = {}

    def slot_of(self, name: str) -> int:
        """The slot of adapter `name` (LoraRefused "unknown" when not loaded)."""
        slot = self._slots.get(name)
        if slot is None:
            raise LoraRefused("unknown", f"LoRA adapter {name!r} is not loaded (loaded: "
                              f"{sorted(self._slots)})")
        return slot

    def free_slot(self, name: str, busy: frozenset[int] = frozenset(),
                  replacing: bool = False) -> int:
        """The slot a new adapter `name` would take, none of `busy` (the slots of replaced
        versions that live requests still use); refused: the name is loaded (unless
        `replacing` it), or every slot is taken."""
        if self.capacity == 0:
            raise LoraRefused("invalid", "LoRA is off in this engine (max_loras_per_batch "
                              "is 0)")
        if name in self._slots and not replacing:
            raise LoraRefused("exists", f"LoRA adapter {name!r} is already loaded; unload "
                              "it first (or load it with load_inplace)")
        used = set(self._slots.values()) | busy
        for slot in range(1, self.capacity + 1):
            if slot not in used:
                return slot
        held = f" and {len(busy)} replaced version(s) live requests still use" if busy else ""
        raise LoraRefused("full", f"every LoRA slot is taken ({len(self._slots)} adapters: "
                          f"{sorted(self._slots)}{held}); unload one first")

    def add(self, adapter: LoraAdapter, slot: int) -> None:
        self._slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> int:
        slot = self.slot_of(name)
        del self._slots[name]
        del self.adapters[name]
        return slot

    def listing(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, slot, rank, scale, target modules, source."""
        return [{"name": n, "slot": s, "rank": self.adapters[n].rank,
                 "scale": self.adapters[n].scale,
                 "target_modules": list(self.adapters[n].target_modules),
                 "source": self.adapters[n].source}
                for n, s in sorted(self._slots.items(), key=lambda kv: kv[1])]
