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
