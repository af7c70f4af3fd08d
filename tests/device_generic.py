"""Which tests run on any accelerator: the `device_generic` marker (`pytest -m
device_generic`, what scripts/device-check.sh runs on a GPU or TPU).

tests/conftest.py marks a test `device_generic` when its file is in DEVICE_GENERIC_FILES
and it needs neither the embedded default model (the `slow` marker, a `default_engine`
fixture or a "default" parameter: the embedded GGUF does not travel to a device image) nor
anything in CPU_ONLY_TESTS. Such a test needs one device of any kind (device 0), JAX, the default
tokenizer's files (`$MULTISERVE_TOKENIZER_DIR` where the embedded model is absent) and
the packages of scripts/device-wheels.sh; it asserts what the code guarantees on every
backend (bitwise invariance, pause/resume identity, accounting), never a CPU kernel name.

CPU_ONLY_FILES says, for the record, why each other file is not device-generic.
"""

from __future__ import annotations

from typing import Any

DEVICE_GENERIC_FILES = frozenset({
    "engine/test_alien_plan.py", "engine/test_background_compile.py",
    "engine/test_batch_admission.py", "engine/test_commands.py",
    "engine/test_control_concurrency.py", "engine/test_flush.py", "engine/test_generate.py",
    "engine/test_no_jax_scheduling.py", "engine/test_output_deltas.py",
    "engine/test_packed_inputs.py", "engine/test_page_allocator.py", "engine/test_pause.py",
    "engine/test_pause_reasons.py", "engine/test_prefix_cache_unit.py",
    "engine/test_prompt_logprobs.py", "engine/test_req_ownership.py",
    "engine/test_request_options.py", "engine/test_resumable.py",
    "engine/test_rl_boundary.py", "engine/test_sampling.py", "engine/test_scheduler_unit.py",
    "engine/test_small_row_buckets.py", "engine/test_step_options.py",
    "engine/test_stress.py", "engine/test_weights.py", "engine/test_window_pages.py",
    "model/test_attention_terms.py",
    "model/test_bf16.py", "model/test_batch_invariance.py", "model/test_kv_pool.py",
    "model/test_precision.py",
    "model/test_row_invariance.py",
})

# tests (node ids relative to tests/) of DEVICE_GENERIC_FILES that are not, and why
_TERMS_CPU = ("the CPU's kernels (the native one) and the Pallas kernels interpreted; the "
              "platform's compiled kernel: test_the_platforms_compiled_kernel_computes_every_term")
CPU_ONLY_TESTS = {
    **{f"model/test_attention_terms.py::{name}": _TERMS_CPU for name in (
        "test_each_kernel_computes_transformers_definition",
        "test_rows_are_bitwise_invariant_with_the_terms",
        "test_a_window_row_reads_no_page_before_its_window",
        "test_the_gpu_kernel_lowers_for_cuda_with_every_term")},
    "engine/test_background_compile.py::test_a_script_raising_while_compiles_run_exits_with_"
    "its_traceback": "a subprocess engine with the compilation cache off: minutes of "
                     "compiles on a fresh device for an exit-path check that is host logic",
}

CPU_ONLY_FILES = {
    "engine/test_determinism.py": "the embedded default model (SmolLM2 GGUF)",
    "engine/test_memory_release.py": "an engine on device 3 of the 4 virtual host devices",
    "engine/test_program_share.py": "an engine on device 3 of the 4 virtual host devices",
    "engine/test_moe_engine.py": "torch (transformers MoE checkpoints) and 2 devices",
    "engine/test_no_torch_at_serving.py": "a subprocess fleet on 4 virtual host devices",
    "engine/test_transfer_groups.py": "jax.experimental.transfer's socket transport, "
                                      "checked on the CPU backend only",
    "model/test_native_kernels.py": "the native C++ CPU kernels (XLA:CPU FFI)",
    "model/test_calibration.py": "probes the native CPU kernels among the candidates",
    "model/test_moe.py": "torch, and the native grouped CPU kernel",
    "model/test_families.py": "torch (transformers' checkpoints of the issue-64 families)",
    "model/test_gpt_oss.py": "torch (transformers' MXFP4 de-quantization)",
    "engine/test_family_engines.py": "torch (transformers' checkpoints and references)",
    "engine/test_family_lora.py": "torch and peft (the adapter and its reference)",
    "model/test_hf_parity.py": "torch (the transformers reference forward)",
    "model/test_default_model.py": "the embedded default model and torch",
    "model/test_sharding.py": "2 and 4 virtual host devices",
    "model/test_gguf.py": "host-only (GGUF parsing): nothing device-specific",
    "model/test_loader.py": "host-only (file loading): nothing device-specific",
    "fleet/": "subprocess fleets of 4 engines on 4 virtual host devices",
    "chaos/": "4 tiny engines on 4 virtual host devices",
    "reliability/": "tiny fleets on virtual host devices; schema fuzzing (host logic)",
    "server/": "the embedded default model behind the servers; HTTP is host logic",
    "plugins/": "the embedded default model",
    "bench/": "torch peers, the embedded model, fleets on virtual host devices",
}

_DEFAULT_MODEL_FIXTURES = ("default_engine", "_default_engine")


def is_device_generic(rel_path: str, item: Any) -> bool:
    """Whether the test `item` (in tests/`rel_path`) runs on any accelerator."""
    if rel_path not in DEVICE_GENERIC_FILES or item.get_closest_marker("slow") is not None:
        return False
    if any(f in getattr(item, "fixturenames", ()) for f in _DEFAULT_MODEL_FIXTURES):
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "default" in params.values():  # parametrized on the embedded model's shapes/weights
        return False
    return f"{rel_path}::{item.name.split('[')[0]}" not in CPU_ONLY_TESTS
