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

On the CPU, float32: XLA:CPU's MLIR fusion emitters off (`xla_cpu_use_fusion_emitters`),
its loop emitters instead: compiling costs ~30% less CPU (the default model's step at 1, 16
and 64 tokens and a 16-row sampler: 3.12 -> 2.19 CPU-s; an engine's first start, a fresh
machine's test suite), and float32 steps run as fast (64 x 128 and single stream within
the run-to-run spread). Not for bfloat16: its steps ran ~3% slower without them. Applied
only where this XLA knows the option (`_known`): one it does not know fails every compile.
Measured in docs/performance.md §28. The calibration's plan and probe keys include these
options (store.py): a plan verified under other options is never reused.
"""

from __future__ import annotations

import functools
import os

_OPTIONS: dict[str, bool | int] = {"xla_allow_excess_precision": False}
_GPU_FLOAT32_OPTIONS: dict[str, bool | int] = {"xla_gpu_enable_triton_gemm": False,
                                               "xla_gpu_autotune_level": 0}
_CPU_FLOAT32_OPTIONS: dict[str, bool | int] = {"xla_cpu_use_fusion_emitters": False}


def step_options(platform: str, dtype: str) -> dict[str, bool | int]:
    """The XLA options of the programs of a model of `dtype` weights ("float32",
    "bfloat16") on `platform` (a device's `.platform`: "cpu", "gpu", "tpu")."""
    if platform == "gpu" and dtype == "float32":
        return {**_OPTIONS, **_GPU_FLOAT32_OPTIONS}
    if platform == "cpu" and dtype == "float32":
        return {**_OPTIONS, **{k: v for k, v in _CPU_FLOAT32_OPTIONS.items() if _known(k)}}
    return dict(_OPTIONS)


# XLA_FLAGS entries that configure no compile: how many virtual devices the CPU platform
# makes (a fleet of 2 engines and one of 4, or a test slice's host, compile the same code).
_NOT_COMPILE_FLAGS = ("xla_force_host_platform_device_count",)


def compile_flags(platform: str, dtype: str) -> str:
    """XLA_FLAGS as far as they can change the machine code of a program compiled with
    `step_options(platform, dtype)`: without the flags that configure no compile
    (`_NOT_COMPILE_FLAGS`) and without those the options set per compile (an option
    passed to a compile overrides the flag). For the calibration's cache keys (store.py)."""
    dropped = {*_NOT_COMPILE_FLAGS, *step_options(platform, dtype)}
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
            if flag.removeprefix("--").partition("=")[0] not in dropped]
    return " ".join(kept)


@functools.cache
def _known(option: str) -> bool:
    """Whether this XLA accepts `option` (a tiny program compiled once per process on the
    CPU backend, which every JAX has; an unknown option fails it: "No such compile
    option")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    arg = jax.ShapeDtypeStruct((1,), jnp.float32,
                               sharding=SingleDeviceSharding(jax.devices("cpu")[0]))
    lowered = jax.jit(lambda x: x + 1).lower(arg)
    try:
        lowered.compile(compiler_options={option: _CPU_FLOAT32_OPTIONS[option]})
    except Exception as exc:  # noqa: BLE001 - XLA's error type is not public
        if "No such compile option" in str(exc):
            return False
        raise
    return True
