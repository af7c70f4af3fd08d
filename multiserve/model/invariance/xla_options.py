"""The XLA options under which the invariance plan holds.

Every program that computes a model's rows compiles with `step_options(platform, dtype)`:
the engine's step, logits and sampler programs (engine/device/step_programs.py), the
calibration's probes (probes.py) and the unbatched reference loop (simple_generate.py), so a plan is verified under the options its steps run
with. A probe compiled with other options verifies other machine code, and on a GPU it
changed the steps' own: on an H200, float32 step programs compiled with these options
still differed between buckets while the probes of the same process used XLA's defaults,
and were bitwise invariant once the probes used these options too (docs/performance.md
§14; the likely mechanism: the probes' autotuned GEMMs, kept in XLA's process-wide
autotuning cache, found by the steps' GEMMs of the same shapes).

`xla_allow_excess_precision` off: XLA may otherwise skip a float32 -> bfloat16 -> float32
rounding (a product's or a norm's bfloat16 output widened again by its consumer) where its
fusion allows, and fusion changes with the step's shapes and formulations, so a bfloat16
row's bits would depend on its batch. No effect on a float32 program (it has no such
conversions).

On a GPU, float32: XLA:GPU picks a GEMM per shape (a Triton tiling or a cuBLAS algorithm,
autotuned), so a float32 row's product could change with the step's bucket; measured on an
H200 (jax 0.11.2): with XLA's defaults float32 logits differed by up to 3e-6 between
batchings, while cuBLAS alone at its heuristic choice (no Triton GEMMs, no autotuning)
kept every float32 batch-invariance test bitwise. bfloat16 is the other way round
(invariant with the defaults, not without Triton), so it keeps them.
"""

from __future__ import annotations

_OPTIONS: dict[str, bool | int] = {"xla_allow_excess_precision": False}
_GPU_FLOAT32_OPTIONS: dict[str, bool | int] = {"xla_gpu_enable_triton_gemm": False,
                                               "xla_gpu_autotune_level": 0}


def step_options(platform: str, dtype: str) -> dict[str, bool | int]:
    """The XLA options of the programs of a model of `dtype` weights ("float32",
    "bfloat16") on `platform` (a device's `.platform`: "cpu", "gpu", "tpu")."""
    if platform == "gpu" and dtype == "float32":
        return {**_OPTIONS, **_GPU_FLOAT32_OPTIONS}
    return dict(_OPTIONS)
