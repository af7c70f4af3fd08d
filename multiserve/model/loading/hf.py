"""Load a Hugging Face model directory: config.json -> ModelConfig, *.safetensors -> params.

Supports every family of model/families (its registry lists the HF architectures: Llama
incl. SmolLM2 and llama3 rope scaling, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mistral, Gemma 2,
Gemma 3, also the text model of Gemma 3's multimodal checkpoints: hf_composite.py); the
fields every family shares are read here, the rest by the family
(`config_from_hf`); one
`model.safetensors` or shards listed in `model.safetensors.index.json`.
Also writes such a directory (`save_hf_dir`), used by the GGUF conversion cache and tests.
Numpy only (no jax, no torch). Every failure is a ModelLoadError naming the file/tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ConfigError, ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families import HF_ARCHITECTURES, architecture_of_hf, family_for
from multiserve.model.loading import safetensors_io
from multiserve.model.loading.hf_composite import text_model_config
from multiserve.model.loading.hf_names import params_from_hf, params_to_hf
from multiserve.model.loading.hf_rope import rope_scaling_from_hf, rope_scaling_to_hf

ARCHITECTURES = HF_ARCHITECTURES  # HF class name -> our architecture (every family's)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: file not found") from e
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot parse: {e}") from e


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


# config.json `hidden_activation` (Gemma's key) or `hidden_act` -> ModelConfig.hidden_act
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(raw: dict[str, Any], source: Path,
                   generation: dict[str, Any] | None = None) -> ModelConfig:
    """Map an HF config.json dict (transformers 4.x or 5.x spelling) to a ModelConfig (a
    multimodal checkpoint's: its text model's, hf_composite.py)."""
    raw = text_model_config(raw)
    archs = raw.get("architectures") or []
    arch = architecture_of_hf(raw)
    if arch is None:
        raise ModelLoadError(f"{source}: unknown architecture {archs or raw.get('model_type')!r};"
                             f" supported: {sorted(ARCHITECTURES)}")
    if raw.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: sliding-window attention is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: activation {act!r} not supported "
                             f"(supported: {sorted(ACTIVATIONS)})")
    rope = raw.get("rope_parameters") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = rope_scaling_from_hf(raw.get("rope_scaling") or rope, source)
    gen = generation or {}
    eos = _ids(gen.get("eos_token_id", raw.get("eos_token_id")))
    bos = gen.get("bos_token_id", raw.get("bos_token_id"))
    try:
        heads = int(raw["num_attention_heads"])
        common = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
            hidden_act=ACTIVATIONS[act])
        return family_for(arch).config_from_hf(raw, arch, source, common)
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing config field {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: invalid config: {e}") from e


def load_hf_config(model_dir: Path) -> ModelConfig:
    raw = _read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else None
    return config_from_hf(raw, model_dir / "config.json", gen)


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{missing[0]}: shard listed in {index.name} not found")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight file found")
    return files


def load_hf_dir(model_dir: Path, dtype) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, numpy params in `dtype`) from an HF model directory."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    cfg = load_hf_config(model_dir)
    files = _safetensor_files(model_dir)
    named: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for f in files:
        for name, arr in safetensors_io.load_file(f).items():
            named[name] = arr
            origin[name] = str(f)
    source: str | dict[str, str] = str(files[0]) if len(files) == 1 else origin
    return cfg, params_from_hf(named, cfg, dtype=dtype, source=source)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF config.json dict for `cfg` (transformers 4.x-compatible spelling)."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[cfg.architecture]
    raw: dict[str, Any] = {
        "architectures": [arch], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": {v: k for k, v in ACTIVATIONS.items()}[cfg.hidden_act],
        "torch_dtype": "float32",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
        else cfg.eos_token_ids[0],
    }
    if cfg.rope_scaling is not None:
        raw["rope_scaling"] = rope_scaling_to_hf(cfg.rope_scaling)
    raw.update(family_for(cfg).config_to_hf(cfg))
    return raw


def save_hf_dir(path: Path | str, cfg: ModelConfig, params: dict[str, Any],
                tokenizer_dir: Path | str | None = None, dtype=np.float32) -> Path:
    """Write config.json, generation_config.json, model.safetensors (in `dtype`) and copy the
    tokenizer files found in `tokenizer_dir`. Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {**config_to_hf(cfg), "torch_dtype": np.dtype(dtype).name}  # what is written
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    named = {k: v.astype(dtype) for k, v in params_to_hf(params, cfg).items()}
    safetensors_io.save_file(named, path / "model.safetensors")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy(Path(tokenizer_dir) / name, path / name)
    if not (path / "generation_config.json").exists():
        gen = {"bos_token_id": cfg.bos_token_id,
               "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
               else cfg.eos_token_ids[0]}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path
