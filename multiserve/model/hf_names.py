"""The mapping between Hugging Face tensor names and our params pytree, both directions.

Owns `hf_tensor_specs` (one HfTensorSpec per HF tensor name: where it lives in our pytree,
its HF shape, whether it is transposed), `params_from_hf` and `params_to_hf`.
HF linear weights are [out, in]; ours are [in, out] (transposed), stacked over layers.
Numpy only (no jax): the loaders and the RL weight-update path use it on the host.

Invariants: `params_from_hf` accepts exactly the names `hf_tensor_specs` lists (plus ignorable
rotary buffers, and `lm_head.weight` when embeddings are tied), each with its HF shape;
anything else raises ModelLoadError naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError

# (our layer key, HF suffix under model.layers.{i}., transposed)
_LAYER_NAMES: tuple[tuple[str, str, bool], ...] = (
    ("attn_norm", "input_layernorm.weight", False),
    ("wq", "self_attn.q_proj.weight", True),
    ("wk", "self_attn.k_proj.weight", True),
    ("wv", "self_attn.v_proj.weight", True),
    ("wo", "self_attn.o_proj.weight", True),
    ("bq", "self_attn.q_proj.bias", False),
    ("bk", "self_attn.k_proj.bias", False),
    ("bv", "self_attn.v_proj.bias", False),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("mlp_norm", "post_attention_layernorm.weight", False),
    ("w_gate", "mlp.gate_proj.weight", True),
    ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HfTensorSpec:
    """Where one HF tensor lives in our params: params[key] (layer None) or
    params["layers"][key][layer]; `hf_shape` is the shape under its HF name."""

    key: str
    layer: int | None
    hf_shape: tuple[int, ...]
    transposed: bool


def hf_tensor_specs(cfg: ModelConfig) -> dict[str, HfTensorSpec]:
    """Every HF tensor name this config's params consist of, in a stable order."""
    from multiserve.model.param_layout import layer_param_shapes

    d, v = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, HfTensorSpec] = {
        "model.embed_tokens.weight": HfTensorSpec("embed", None, (v, d), False)}
    shapes = layer_param_shapes(cfg)
    for i in range(cfg.num_layers):
        for key, suffix, transposed in _LAYER_NAMES:
            if key in shapes:
                shape = shapes[key][::-1] if transposed else shapes[key]
                specs[f"model.layers.{i}.{suffix}"] = HfTensorSpec(key, i, shape, transposed)
    specs["model.norm.weight"] = HfTensorSpec("final_norm", None, (d,), False)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = HfTensorSpec("lm_head", None, (v, d), True)
    return specs


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or (
        cfg.tie_word_embeddings and name == "lm_head.weight")


def params_from_hf(named: dict[str, Any], cfg: ModelConfig, dtype=None,
                   source: str | Mapping[str, str] = "<tensors>") -> dict[str, Any]:
    """Build our params pytree (numpy) from HF-named arrays. Validates every name and shape;
    errors name the file (`source`, or `source[name]` per tensor) and the tensor.
    `dtype` None keeps each array's dtype."""
    def src(name: str) -> str:
        if isinstance(source, str):
            return source
        return source.get(name) or ", ".join(sorted(set(source.values()))) or "<tensors>"

    specs = hf_tensor_specs(cfg)
    unknown = sorted(n for n in named if n not in specs and not _ignorable(n, cfg))
    if unknown:
        raise ModelLoadError(f"{src(unknown[0])}: unexpected tensor {unknown[0]!r} for a "
                             f"{cfg.architecture} config ({len(unknown)} unexpected in all)")
    per_layer: dict[str, list[Any]] = {}
    params: dict[str, Any] = {}
    for name, spec in specs.items():
        if name not in named:
            raise ModelLoadError(f"{src(name)}: missing tensor {name!r}")
        arr = np.asarray(named[name])
        if tuple(arr.shape) != spec.hf_shape:
            raise ModelLoadError(f"{src(name)}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                 f"expected {spec.hf_shape}")
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        arr = arr.T if spec.transposed else arr
        if spec.layer is None:
            params[spec.key] = np.array(arr, order="C")  # own, writable memory (not a mmap)
        else:
            per_layer.setdefault(spec.key, []).append(arr)
    params["layers"] = {k: np.stack(v) for k, v in per_layer.items()}
    return params


def params_to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (contiguous, HF orientation) from our params pytree."""
    out: dict[str, np.ndarray] = {}
    for name, spec in hf_tensor_specs(cfg).items():
        if spec.layer is None:
            arr = np.asarray(params[spec.key])
        else:
            arr = np.asarray(params["layers"][spec.key][spec.layer])
        out[name] = np.ascontiguousarray(arr.T if spec.transposed else arr)
    return out
