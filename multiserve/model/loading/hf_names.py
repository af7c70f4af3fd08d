"""The mapping between Hugging Face tensor names and our params pytree, both directions.

Owns `hf_tensor_specs` (one HfTensorSpec per HF tensor name: where it lives in our pytree,
its HF shape, whether it is transposed), `params_from_hf` and `params_to_hf`.
HF linear weights are [out, in]; ours are [in, out] (transposed), stacked over layers.
Numpy only (no jax): the loaders and the RL weight-update path use it on the host.

Invariants: `params_from_hf` accepts exactly the names `hf_tensor_specs` lists (plus ignorable
rotary buffers, and `lm_head.weight` when embeddings are tied), each with its HF shape,
after a multimodal checkpoint's text tensors took their text-model names and its other
parts were left out (hf_composite.py); anything else raises ModelLoadError naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.host.populated import populated_empty
from multiserve.model.errors import ModelLoadError
from multiserve.model.families import family_for
from multiserve.model.families.base import HfTensorSpec
from multiserve.model.loading.hf_composite import text_model_tensors

__all__ = ["HfTensorSpec", "hf_tensor_specs", "params_from_hf", "params_to_hf"]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_tensor_specs(cfg: ModelConfig) -> dict[str, HfTensorSpec]:
    """Every HF tensor name this config's params consist of, in a stable order (the
    family's, model/families)."""
    return family_for(cfg).hf_tensor_specs(cfg)


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
    named = family_for(cfg).unpack_hf_tensors(text_model_tensors(named, cfg.architecture), cfg)
    unknown = sorted(n for n in named if n not in specs and not _ignorable(n, cfg))
    if unknown:
        raise ModelLoadError(f"{src(unknown[0])}: unexpected tensor {unknown[0]!r} for a "
                             f"{cfg.architecture} config ({len(unknown)} unexpected in all)")
    stacked: dict[tuple[str, ...], dict[tuple[int, ...], Any]] = {}
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
        if spec.layer is None:  # own, writable memory (not the file's mapping)
            own = populated_empty(arr.shape, arr.dtype)
            own[...] = arr
            params[spec.key] = own
        else:
            stacked.setdefault(spec.path, {})[spec.index] = arr
    for (group, key), parts in stacked.items():
        params.setdefault(group, {})[key] = _stack(parts)
    return params


def _stack(parts: dict[tuple[int, ...], Any]) -> np.ndarray:
    """One stacked leaf from its pieces keyed by (layer,) or (layer, expert), every index
    present (the specs list them all)."""
    first = next(iter(parts.values()))
    if len(next(iter(parts))) == 1:
        out = populated_empty((len(parts), *first.shape), first.dtype)
        return np.stack([parts[(i,)] for i in range(len(parts))], out=out)
    layers = 1 + max(i for i, _ in parts)
    experts = len(parts) // layers
    out = populated_empty((layers, experts, *first.shape), first.dtype)
    for i in range(layers):
        np.stack([parts[(i, e)] for e in range(experts)], out=out[i])
    return out


def params_to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (contiguous, HF orientation) from our params pytree."""
    out: dict[str, np.ndarray] = {}
    for name, spec in hf_tensor_specs(cfg).items():
        if spec.layer is None:
            arr = np.asarray(params[spec.key])
        else:
            arr = np.asarray(params[spec.group][spec.key][spec.index])
        out[name] = np.ascontiguousarray(arr.T if spec.transposed else arr)
    return out
