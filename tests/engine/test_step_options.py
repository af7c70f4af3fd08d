"""The XLA options of the step programs (model/invariance/xla_options.step_options).

What is checked: every option set the rule can give is one XLA accepts (a misspelt option
name fails the compile: "No such compile option"), whatever backend the test runs on; and
the rule itself: excess precision off everywhere; on a GPU, float32 programs without
Triton GEMMs and without autotuning (cuBLAS at its heuristic choice), which kept float32
batch-invariant on an H200 where XLA's defaults did not; on the CPU, float32 programs
without XLA:CPU's fusion emitters (where this XLA knows the option; it compiles faster);
bfloat16 and other platforms keep XLA's defaults otherwise. And the calibration's plan key
names the options, so a plan verified under other options is never reused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.xla_options import step_options

PLATFORMS = ("cpu", "gpu", "tpu")
DTYPES = ("float32", "bfloat16")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_set_compiles_and_computes(platform: str, dtype: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    lowered = jax.jit(lambda x: jnp.dot(x, x.T)).lower(jnp.asarray(a))
    program = lowered.compile(compiler_options=step_options(platform, dtype))
    np.testing.assert_array_equal(np.asarray(program(jnp.asarray(a))), a @ a.T)


def test_a_misspelt_option_is_refused() -> None:
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(3))
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile(compiler_options={"xla_gpu_enable_triton_gem": False})


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rule(platform: str, dtype: str) -> None:
    options = step_options(platform, dtype)
    assert options["xla_allow_excess_precision"] is False
    gpu_float32 = platform == "gpu" and dtype == "float32"
    assert options.get("xla_gpu_enable_triton_gemm", True) is not gpu_float32
    assert options.get("xla_gpu_autotune_level") == (0 if gpu_float32 else None)
    cpu_float32 = platform == "cpu" and dtype == "float32"
    # jax 0.10.2's XLA (the suite's pin) knows the option
    assert options.get("xla_cpu_use_fusion_emitters", True) is not cpu_float32


def test_an_option_this_xla_does_not_know_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiserve.model.invariance import xla_options

    monkeypatch.setattr(xla_options, "_CPU_FLOAT32_OPTIONS",
                        {"xla_cpu_no_such_option_in_this_test": False})
    assert "xla_cpu_no_such_option_in_this_test" not in step_options("cpu", "float32")
    assert xla_options._known("xla_cpu_no_such_option_in_this_test") is False


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_plan_key_names_the_options(dtype: str) -> None:
    from multiserve.model.invariance.store import backend_key
    from multiserve.model.invariance.workload import AttentionUse, Workload

    use = AttentionUse(kv_heads=2, group=2, head_dim=16, page_size=4, block_size=8,
                       sizes=(1, 4))
    device = jax.devices()[0]
    key = backend_key(device, Workload(dtype=dtype, products=(), row_sums=(), attention=use))
    assert key["xla_options"] == step_options(device.platform, dtype)


def test_the_cache_keys_name_only_the_xla_flags_that_can_change_a_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host platform's device count configures no compile, and a flag the step options
    set per compile is overridden by them: neither splits the calibration's plan or probe
    caches (a fleet of 2 engines reuses a fleet of 4's probes); any other flag does."""
    from multiserve.model.invariance.store import backend_key, probe_file_key
    from multiserve.model.invariance.workload import AttentionUse, Workload
    from multiserve.model.invariance.xla_options import compile_flags

    use = AttentionUse(kv_heads=2, group=2, head_dim=16, page_size=4, block_size=8,
                       sizes=(1, 4))
    device = jax.devices()[0]

    def keys(flags: str, dtype: str) -> tuple[dict, dict]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        workload = Workload(dtype=dtype, products=(), row_sums=(), attention=use)
        return (backend_key(device, workload),
                probe_file_key((device.platform, device.device_kind, dtype, "product", 64)))

    fast_math = "--xla_cpu_enable_fast_math=true"
    for dtype in DTYPES:
        plain = keys("--xla_force_host_platform_device_count=2", dtype)
        assert keys("--xla_force_host_platform_device_count=4 "
                    "--xla_allow_excess_precision=false", dtype) == plain
        assert keys("--xla_allow_excess_precision=true", dtype) == plain  # overridden
        other = keys(f"--xla_force_host_platform_device_count=4 {fast_math}", dtype)
        assert other[0] != plain[0] and other[1] != plain[1]
        assert other[0]["xla_flags"] == other[1]["xla_flags"] == fast_math
    # an option the step options set only for float32 on the CPU
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    assert compile_flags("cpu", "float32") == ""
    assert compile_flags("cpu", "bfloat16") == "--xla_cpu_use_fusion_emitters=false"


_OVERRIDE_SCRIPT = """
import jax, jax.numpy as jnp
lowered = jax.jit(lambda x: jnp.exp(x * 3.0) + jnp.sin(x)).lower(jnp.ones(8, jnp.float32))
print(["fusion" in lowered.compile(compiler_options=o).as_text()
       for o in ({}, {"xla_disable_all_hlo_passes": False})])
"""


def test_an_option_passed_to_a_compile_overrides_the_same_xla_flag() -> None:
    """What `compile_flags` relies on, on the installed XLA: with every HLO pass disabled
    by XLA_FLAGS, a compile passing the option back on fuses again."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_disable_all_hlo_passes=true",
           "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    out = subprocess.run([sys.executable, "-c", _OVERRIDE_SCRIPT], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[False, True]", out.stdout
