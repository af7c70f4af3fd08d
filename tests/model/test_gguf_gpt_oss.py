"""GPT-OSS from GGUF (loading/gguf_gpt_oss.py): a transformers-written GPT-OSS checkpoint
converted as llama.cpp's converter does (split or fused gate / up experts, float32 or the
released MXFP4 repacked into ggml's MXFP4) loads with the config and every tensor of the
checkpoint itself, bit for bit; a file missing an expert tensor fails naming it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from family_checkpoints import to_mxfp4, write
from gguf_helpers import write_gpt_oss_gguf

from multiserve.model.errors import ModelLoadError
from multiserve.model.loading.gguf_gpt_oss import assemble_experts
from multiserve.model.loading.hf_names import params_to_hf
from multiserve.model.loading.loader import load_model

# every released GPT-OSS clamps its SwiGLU at 7.0, the value llama.cpp's gpt-oss runs with
# and a GGUF does not record (the shared test config's 1.5 is reached by its random weights)
RELEASED = dict(swiglu_limit=7.0)


def assert_same_model(gguf_path: Path, hf_dir: Path, dtype: str = "float32") -> None:
    from_gguf, from_hf = load_model(str(gguf_path), dtype), load_model(str(hf_dir), dtype)
    # GGUF stores eps as float32: the same number once the model's float32 arithmetic has it
    assert np.float32(from_gguf.config.rms_norm_eps) == np.float32(from_hf.config.rms_norm_eps)
    assert replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) == from_hf.config
    cfg = from_hf.config
    assert cfg.architecture == "gpt_oss" and cfg.sliding_layers == (0, 2)
    assert cfg.rope_scaling is not None and not cfg.rope_scaling.truncate
    a, b = params_to_hf(from_gguf.params, cfg), params_to_hf(from_hf.params, cfg)
    assert a.keys() == b.keys()
    assert "model.layers.2.mlp.experts.gate_up_proj_bias" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_gguf_loads_as_its_checkpoint(fused: bool, tmp_path: Path) -> None:
    hf_dir = write("gpt_oss", tmp_path / "hf", **RELEASED)
    assert_same_model(write_gpt_oss_gguf(tmp_path / "g.gguf", hf_dir, fused=fused), hf_dir)


def test_gpt_oss_gguf_mxfp4_experts_are_the_released_values(tmp_path: Path) -> None:
    """MXFP4 experts repacked into ggml's MXFP4 de-quantize to the values transformers'
    de-quantization of the released blocks gives: the same params in float32 and bf16."""
    hf_dir = to_mxfp4(write("gpt_oss", tmp_path / "hf", **RELEASED))
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", hf_dir)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert kinds["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    for dtype in ("float32", "bfloat16"):
        assert_same_model(path, hf_dir, dtype)


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    parts = {(0, "gate", "weight"): np.zeros((4, 8, 32), np.float32),
             (0, "gate", "bias"): np.zeros((4, 8), np.float32),
             (0, "up", "bias"): np.zeros((4, 8), np.float32)}
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up_exps\.weight"):
        assemble_experts(parts, 1, tmp_path / "x.gguf")
