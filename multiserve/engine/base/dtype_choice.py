"""The engine's compute dtype (weights, activations, KV pool): `EngineConfig.dtype`, with
"auto" resolved here, and the reason, which get_internal_state / get_server_info
(`dtype_choice`) and `multiserve doctor` report.

"auto" is the checkpoint's precision wherever it runs well, else float32:
- the embedded default model: EMBEDDED_MODEL_DTYPE on every platform (decided by
  measurement and exactness, see there);
- a checkpoint that declares bfloat16 (config.json `torch_dtype`, newer transformers write
  `dtype`): bfloat16 on an accelerator, and on a CPU where the native bfloat16 kernels run
  (XLA:CPU's bfloat16 formulations are far slower: float32 otherwise);
- a float16 checkpoint: float16 on an accelerator, float32 on a CPU (no native float16
  kernels);
- a float32 checkpoint, or one that declares nothing: float32 (its bits kept; on an
  accelerator the products still sum in float32: `Precision.HIGHEST`,
  model/invariance/primitives.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# What the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF de-quantized at load)
# serves in on a CPU, and why. "auto" means the checkpoint's precision: the de-quantized
# weights are exact in float32 and not in bfloat16, so float32, though bfloat16 measured
# faster here once its KV writes went native (docs/performance.md §4).
EMBEDDED_MODEL_DTYPE = "float32"
EMBEDDED_MODEL_REASON = ("the embedded default model: its GGUF holds Q4_1 blocks whose "
                         "de-quantized values bfloat16 cannot hold exactly; float32 keeps "
                         "them (and its outputs equal to its float32 references). "
                         "dtype=bfloat16 serves it faster (docs/performance.md)")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype an engine computes in: what was asked, what runs, and why."""

    requested: str  # EngineConfig.dtype ("auto", "float32", "bfloat16", "float16")
    dtype: str  # the dtype that runs
    reason: str

    def summary(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a Hugging Face checkpoint declares (config.json `torch_dtype` or
    `dtype`), None when it declares none or the file is unreadable."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("torch_dtype") or raw.get("dtype")
    return str(value).removeprefix("torch.") if value else None


def choose_dtype(requested: str, platform: str, model_dir: Path | None,
                 bf16_unavailable: str | None, bf16_paths: str | None) -> DtypeChoice:
    """The engine's dtype for EngineConfig.dtype `requested` on `platform` ("cpu", "gpu",
    "tpu"); `model_dir` the checkpoint (None: the embedded default model);
    `bf16_unavailable` why the native bfloat16 kernels cannot run here (None: they can,
    by the instruction paths `bf16_paths`, among which the calibration chooses)."""
    if requested != "auto":
        return DtypeChoice(requested, requested, "set explicitly (EngineConfig.dtype)")
    where = "CPU" if platform == "cpu" else platform
    if model_dir is None:
        return DtypeChoice(requested, EMBEDDED_MODEL_DTYPE,
                           f"auto on {where}: {EMBEDDED_MODEL_REASON}")
    declared = checkpoint_dtype(model_dir)
    if platform != "cpu" and declared in ("bfloat16", "float16"):
        return DtypeChoice(requested, declared, f"auto on {where}: the checkpoint's dtype "
                           f"(config.json torch_dtype {declared})")
    if declared == "bfloat16" and bf16_unavailable is not None:
        return DtypeChoice(requested, "float32", "auto on CPU: float32, the native bfloat16 "
                           f"kernels do not run here ({bf16_unavailable})")
    if declared == "bfloat16":
        return DtypeChoice(requested, "bfloat16", "auto on CPU: the checkpoint's dtype "
                           f"(config.json torch_dtype bfloat16), native bfloat16 kernels "
                           f"(paths {bf16_paths}: the calibration times them)")
    return DtypeChoice(requested, "float32", f"auto on {where}: the checkpoint declares "
                       f"{declared or 'no dtype'}, served in float32 (its bits kept)")
