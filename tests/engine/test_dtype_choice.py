"""`dtype="auto"`: the checkpoint's precision where it runs well, else float32, on every
platform (engine/base/dtype_choice.py). Pure logic: no device, no model load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multiserve.engine.base.dtype_choice import EMBEDDED_MODEL_DTYPE, choose_dtype

NATIVE = dict(bf16_unavailable=None, bf16_paths="avx512_bf16, widen")
NO_NATIVE = dict(bf16_unavailable="no C++ compiler", bf16_paths=None)


def _checkpoint(tmp_path: Path, declared: str | None, key: str = "torch_dtype") -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if declared is not None:
        cfg[key] = declared
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize(("declared", "served"), [
    ("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
    (None, "float32")])
def test_auto_on_an_accelerator_serves_the_checkpoint_dtype(
        tmp_path: Path, platform: str, declared: str | None, served: str) -> None:
    # a float32 checkpoint stays float32 on an accelerator (the first H200 run served the
    # tests' float32 models in bfloat16 and every float32 reference disagreed)
    choice = choose_dtype("auto", platform, _checkpoint(tmp_path, declared), **NO_NATIVE)
    assert (choice.requested, choice.dtype) == ("auto", served)
    assert platform in choice.reason


@pytest.mark.parametrize(("declared", "native", "served"), [
    ("bfloat16", NATIVE, "bfloat16"), ("bfloat16", NO_NATIVE, "float32"),
    ("float16", NATIVE, "float32"), ("float32", NATIVE, "float32"), (None, NATIVE, "float32")])
def test_auto_on_a_cpu_serves_bfloat16_only_where_the_native_kernels_run(
        tmp_path: Path, declared: str | None, native: dict, served: str) -> None:
    choice = choose_dtype("auto", "cpu", _checkpoint(tmp_path, declared), **native)
    assert choice.dtype == served
    if served == "bfloat16":
        assert "avx512_bf16" in choice.reason
    if declared == "bfloat16" and served == "float32":
        assert "no C++ compiler" in choice.reason


def test_newer_transformers_dtype_key_is_read(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path, "bfloat16", key="dtype")
    assert choose_dtype("auto", "cpu", model, **NATIVE).dtype == "bfloat16"


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_the_embedded_model_is_served_alike_everywhere(platform: str) -> None:
    choice = choose_dtype("auto", platform, None, **NATIVE)
    assert choice.dtype == EMBEDDED_MODEL_DTYPE and "embedded default model" in choice.reason


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("asked", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept(tmp_path: Path, platform: str, asked: str) -> None:
    choice = choose_dtype(asked, platform, _checkpoint(tmp_path, "float16"), **NO_NATIVE)
    assert (choice.requested, choice.dtype) == (asked, asked)
