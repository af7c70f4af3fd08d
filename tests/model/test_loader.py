"""HF-dir loading: sharded safetensors with an index, round trip through save_hf_dir and
params_to_hf/params_from_hf, bfloat16 loading, and clear errors (naming the file/tensor) for
a missing dir, a missing config.json, an unknown architecture, a missing or mis-shaped
tensor, and an unexpected tensor."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from model_helpers import TINY_LLAMA

from multiserve.model.loading import safetensors_io
from multiserve.model.errors import ModelLoadError
from multiserve.model.loading.hf import save_hf_dir
from multiserve.model.loading.hf_names import params_from_hf, params_to_hf
from multiserve.model.loading.loader import load_model
from multiserve.model.loading.param_layout import init_random_params


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    return save_hf_dir(tmp_path / "m", TINY_LLAMA, init_random_params(TINY_LLAMA, seed=4))


def test_round_trip_and_sharded_index(model_dir: Path, tmp_path: Path) -> None:
    whole = load_model(str(model_dir), "float32")
    assert whole.config == TINY_LLAMA and whole.tokenizer_dir == model_dir
    named = params_to_hf(whole.params, TINY_LLAMA)
    again = params_to_hf(params_from_hf(named, TINY_LLAMA), TINY_LLAMA)
    assert all(np.array_equal(named[k], again[k]) for k in named)
    # split into two shards listed by model.safetensors.index.json
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((model_dir / "config.json").read_text())
    names = sorted(named)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        safetensors_io.save_file({k: named[k] for k in keys}, sharded / fname)
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    split = params_to_hf(load_model(str(sharded), "float32").params, TINY_LLAMA)
    assert all(np.array_equal(named[k], split[k]) for k in named)


def test_bfloat16_load(model_dir: Path) -> None:
    loaded = load_model(str(model_dir), "bfloat16")
    assert loaded.params["layers"]["wq"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_missing_dir_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model.*not found"):
        load_model(str(tmp_path / "no-such-model"), "float32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty/config\.json.*not found"):
        load_model(str(tmp_path / "empty"), "float32")


def test_unknown_architecture(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json.*unknown architecture.*GPT2"):
        load_model(str(model_dir), "float32")


def _rewrite(model_dir: Path, change) -> Path:
    path = model_dir / "model.safetensors"
    tensors = {k: np.array(v) for k, v in safetensors_io.load_file(path).items()}
    change(tensors)
    path.unlink()
    safetensors_io.save_file(tensors, path)
    return path


def test_missing_tensor(model_dir: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    path = _rewrite(model_dir, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(model_dir), "float32")
    assert str(path) in str(err.value) and f"missing tensor '{name}'" in str(err.value)


def test_misshaped_tensor(model_dir: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _rewrite(model_dir, lambda t: t.update({name: np.zeros((8, 64), np.float32)}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(model_dir), "float32")
    msg = str(err.value)
    assert str(path) in msg and name in msg and "(8, 64)" in msg and "(32, 64)" in msg


def test_unexpected_tensor(model_dir: Path) -> None:
    path = _rewrite(model_dir, lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ModelLoadError, match=f"{path}.*unexpected tensor 'model.extra.weight'"):
        load_model(str(model_dir), "float32")
