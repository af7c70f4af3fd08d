"""Validation of weight updates against one model's params layout, and reading them back.

Owns `ParamLayout` (per model config): the HF tensor names (`hf_names.hf_tensor_specs`,
the model family's) and our pytree's leaf shapes (dense and MoE leaves alike: a stacked
leaf is indexed by layer, an expert leaf by (layer, expert)); `validate()` turns a flat
{HF name: array} dict (or pairs, a subset allowed) or a params pytree into whole new
leaves plus per-layer slices of stacked leaves, raising WeightUpdateError that names the
tensor (unknown name, missing, shape, non-floating dtype, NaN/inf; a multimodal
checkpoint's text tensors go by their text-model names, its vision parts are not served:
hf_composite.py); `read_disk()` reads an
HF safetensors dir (memory-mapped) after checking its config.json against the served
model; `read()` returns the first rows of one tensor.

Invariant: nothing here touches engine state or creates device buffers except `read()`'s
small device-to-host slice; it runs on any thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families import family_for
from multiserve.model.loading import safetensors_io
from multiserve.model.loading.hf_composite import text_model_name, text_model_tensors
from multiserve.model.loading.hf_names import HfTensorSpec, hf_tensor_specs
from multiserve.model.loading.param_layout import param_shapes
from multiserve.model.param_tree import LeafPath, get_leaf, leaf_paths

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Full = dict[LeafPath, Any]  # whole new leaves
# stacked leaf -> (layer indexes [k], or (layer, expert) pairs [k, 2]; values [k, ...])
Partial = dict[LeafPath, tuple[np.ndarray, Any]]


class WeightUpdateError(ValueError):
    """An update was refused or is invalid; the message names the tensor or the reason."""


def _check_dtype(name: str, x: Any, where: str = "") -> None:
    dt = np.dtype(x.dtype)
    if not (np.issubdtype(dt, np.floating) or dt == np.dtype(ml_dtypes.bfloat16)):
        raise WeightUpdateError(f"{where}tensor {name!r}: dtype {dt} is not a floating-point "
                                "type")


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_finite(name: str, x: Any, where: str = "") -> None:
    ok = finite_each([x])[0] if isinstance(x, jax.Array) else bool(
        np.isfinite(np.asarray(x)).all())
    if not ok:
        raise WeightUpdateError(f"{where}tensor {name!r}: has NaN or inf values")


@jax.jit
def _each_finite(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in xs])


_HOST_CHUNK = 1 << 22  # elements tested at a time on the host (bounds the mask's memory)


def _host_finite(a: np.ndarray) -> bool:
    """Whether host array `a` is all finite, read in place chunk by chunk; a bfloat16
    value is finite where its exponent bits are not all ones (inf and NaN are)."""
    v = a.reshape(-1)
    bf16 = v.dtype == np.dtype(ml_dtypes.bfloat16)
    if bf16:
        v = v.view(np.uint16)
    for i in range(0, v.size, _HOST_CHUNK):
        part = v[i:i + _HOST_CHUNK]
        if not (((part & 0x7F80) != 0x7F80).all() if bf16 else np.isfinite(part).all()):
            return False
    return True


def _in_host_memory(x: jax.Array) -> bool:
    """Whether every shard of `x` lives in this process's memory (CPU devices): its values
    can then be read in place, with no program to compile."""
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())


def finite_each(xs: list[jax.Array]) -> list[bool]:
    """Whether each array is all finite. Arrays on CPU devices are read in place on the
    host (each shard once: a compiled check costs a compile per list of shapes, seconds
    for a model's tree, and the values are already in this memory); the others in ONE
    compiled program for all of them (one compile per list of shapes, where a program per
    array shape cost a compile for each distinct leaf shape of a model), which must
    live on the same devices."""
    out: list[bool | None] = [
        all(_host_finite(np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0)
        if _in_host_memory(x) else None for x in xs]
    rest = [x for x, ok in zip(xs, out, strict=True) if ok is None]
    if rest:
        found = iter(bool(b) for b in np.asarray(_each_finite(rest)))
        out = [next(found) if ok is None else ok for ok in out]
    return [bool(ok) for ok in out]


class ParamLayout:
    """The params layout of one model config (see module docstring)."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        self.model_cfg = model_cfg
        self.shapes = param_shapes(model_cfg)
        self.paths = leaf_paths(self.shapes)
        self.specs: dict[str, HfTensorSpec] = hf_tensor_specs(model_cfg)

    def check_specs(self, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]]) -> None:
        """The checks `validate` makes of HF-named tensors that need no value (known name,
        shape, floating dtype), made of a description before any array exists (a weight
        transfer's names, dtypes and shapes). Raises WeightUpdateError naming the tensor."""
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            spec = self._spec(name, "")
            if spec is None:
                continue
            if tuple(shape) != spec.hf_shape:
                raise WeightUpdateError(f"tensor {name!r}: shape {tuple(shape)}, expected "
                                        f"{spec.hf_shape}")
            dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
            _check_dtype(name, np.empty(0, dt))

    def validate(self, tensors: Any, require_all: bool, source: str = "<tensors>",
                 check_finite: bool = True) -> tuple[Full, Partial, int]:
        """(whole leaves, per-layer slices, number of tensors given); arrays untouched
        (transposed/stacked views of the caller's data, not yet cast). check_finite=False
        reads no value (names, shapes and dtypes only)."""
        if isinstance(tensors, Mapping) and set(tensors) and set(tensors) <= set(self.shapes):
            full = self._validate_tree(tensors, require_all, check_finite)
            return full, {}, len(full)
        named = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
        return self._validate_named(named, require_all, source, check_finite)

    def _validate_tree(self, tree: Mapping[str, Any], require_all: bool,
                       check_finite: bool = True) -> dict[LeafPath, Any]:
        out: dict[LeafPath, Any] = {}
        for k, v in tree.items():
            if k not in self.shapes:
                raise WeightUpdateError(f"tensor {k!r}: not a parameter of this model "
                                        f"(expected one of {sorted(self.shapes)})")
            if isinstance(self.shapes[k], Mapping):
                if not isinstance(v, Mapping):
                    raise WeightUpdateError(f"tensor {k!r}: expected a dict of stacked layer "
                                            f"params, got {type(v).__name__}")
                for kk, vv in v.items():
                    if kk not in self.shapes[k]:
                        raise WeightUpdateError(f"tensor '{k}/{kk}': not a parameter of this "
                                                f"model")
                    out[(k, kk)] = vv
            else:
                out[(k,)] = v
        if require_all:
            missing = [p for p in self.paths if p not in out]
            if missing:
                raise WeightUpdateError(f"tensor {'/'.join(missing[0])!r}: missing "
                                        f"({len(missing)} missing in all)")
        for path, x in out.items():
            name = "/".join(path)
            if not _is_array(x):
                raise WeightUpdateError(f"tensor {name!r}: not an array ({type(x).__name__})")
            want = get_leaf(self.shapes, path)
            if tuple(x.shape) != tuple(want):
                raise WeightUpdateError(f"tensor {name!r}: shape {tuple(x.shape)}, expected "
                                        f"{tuple(want)}")
            _check_dtype(name, x)
            if check_finite:
                _check_finite(name, x)
        return out

    def _spec(self, name: str, where: str) -> HfTensorSpec | None:
        """The spec of HF tensor `name`; None for a name an update skips (rotary caches, a
        tied head); raises WeightUpdateError for a name that is no parameter of the model."""
        cfg = self.model_cfg
        text = text_model_name(name, cfg.architecture)  # a multimodal checkpoint's names
        if text is None or text.endswith(_IGNORED_SUFFIXES) or (
                cfg.tie_word_embeddings and text == "lm_head.weight"):
            return None
        spec = self.specs.get(text)
        if spec is None:
            raise WeightUpdateError(f"{where}tensor {name!r}: not a parameter of this "
                                    f"{cfg.architecture} model")
        return spec

    def _validate_named(self, named: dict[str, Any], require_all: bool, source: str,
                        check_finite: bool = True) -> tuple[Full, Partial, int]:
        where = "" if source == "<tensors>" else f"{source}: "
        named = text_model_tensors(named, self.model_cfg.architecture)
        given: dict[str, Any] = {}
        for name, x in named.items():
            spec = self._spec(name, where)
            if spec is None:
                continue
            if not _is_array(x):
                raise WeightUpdateError(f"{where}tensor {name!r}: not an array "
                                        f"({type(x).__name__})")
            if tuple(x.shape) != spec.hf_shape:
                raise WeightUpdateError(f"{where}tensor {name!r}: shape {tuple(x.shape)}, "
                                        f"expected {spec.hf_shape}")
            _check_dtype(name, x, where)
            if check_finite:
                _check_finite(name, x, where)
            given[name] = x
        if require_all:
            missing = [n for n in self.specs if n not in given]
            if missing:
                raise WeightUpdateError(f"{where}tensor {missing[0]!r}: missing "
                                        f"({len(missing)} missing in all)")
        if not given:
            raise WeightUpdateError(f"{where}no tensor to update")
        # group per leaf: whole leaves, or a subset of a stacked leaf's layers (MoE expert
        # leaves: of its (layer, expert) entries)
        by_leaf: dict[LeafPath, dict[tuple[int, ...], Any]] = {}
        for name, x in given.items():
            spec = self.specs[name]
            xt = _transpose(x) if spec.transposed else x
            by_leaf.setdefault(spec.path, {})[spec.index] = xt
        full: Full = {}
        partial: Partial = {}
        for path, parts in by_leaf.items():
            if () in parts:
                full[path] = parts[()]
                continue
            index = sorted(parts)
            stacked = _stack([parts[i] for i in index])
            leaf_shape = get_leaf(self.shapes, path)
            if len(index) == int(np.prod(leaf_shape[:len(index[0])])):  # every entry given
                full[path] = stacked.reshape(leaf_shape)
            else:
                idx = np.asarray(index, np.int32)
                partial[path] = (idx[:, 0] if idx.shape[1] == 1 else idx, stacked)
        return full, partial, len(given)

    # ---- disk ------------------------------------------------------------------------
    def read_disk(self, path: str | Path) -> tuple[dict[str, np.ndarray], str]:
        """HF-named tensors (memory-mapped) of a safetensors model dir; checks its
        config.json (when present) against the serving model."""
        model_dir = Path(path).expanduser()
        if not model_dir.is_dir():
            raise WeightUpdateError(f"{model_dir}: not a directory")
        self._check_config(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise WeightUpdateError(f"{index}: cannot read the weight map: {e}") from e
            files = [model_dir / f for f in sorted(set(wm.values()))]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"{model_dir}: no *.safetensors file")
        named: dict[str, np.ndarray] = {}
        for f in files:
            if not f.exists():
                raise WeightUpdateError(f"{f}: listed in the index but missing")
            try:
                named.update(safetensors_io.load_file(f))
            except ModelLoadError as e:
                raise WeightUpdateError(str(e)) from e
        return named, str(model_dir)

    def _check_config(self, model_dir: Path) -> None:
        cfg_file = model_dir / "config.json"
        if not cfg_file.exists():
            return
        from multiserve.model.loading.hf import load_hf_config

        try:
            theirs = load_hf_config(model_dir)
        except ModelLoadError as e:
            raise WeightUpdateError(str(e)) from e
        for f in family_for(self.model_cfg).config_fields:
            a, b = getattr(theirs, f), getattr(self.model_cfg, f)
            if a != b:
                raise WeightUpdateError(f"{cfg_file}: {f} is {a!r} but the served model has "
                                        f"{b!r}")

    # ---- reading weights back -----------------------------------------------------------------
    def read(self, leaf_at: Callable[[LeafPath], Any], name: str,
             truncate_size: int) -> dict[str, Any]:
        """The first `truncate_size` rows (dim 0) of tensor `name` (HF name, HF
        orientation; or a pytree path like "embed" / "layers/wq"), its leaf given by
        `leaf_at(path)` (from the device params or their host copy; only that leaf is
        asked for)."""
        spec = self.specs.get(text_model_name(name, self.model_cfg.architecture) or name)
        if spec is not None:
            leaf = leaf_at(spec.path)
            x = leaf[spec.index] if spec.index else leaf
            shape = spec.hf_shape
            x = x[:, :truncate_size].T if spec.transposed else x[:truncate_size]
        else:
            path = tuple(p for p in name.replace(".", "/").split("/") if p)
            try:
                shape_or_group = get_leaf(self.shapes, path)
            except (KeyError, TypeError):
                raise WeightUpdateError(f"tensor {name!r}: not a parameter of this model "
                                        "(give an HF name such as "
                                        "'model.layers.0.self_attn.q_proj.weight')") from None
            if isinstance(shape_or_group, Mapping):
                raise WeightUpdateError(f"tensor {name!r}: names a group, not a tensor")
            leaf = leaf_at(path)
            shape, x = tuple(leaf.shape), leaf[:truncate_size]
        values = np.asarray(jax.device_get(x))
        return {"name": name, "shape": list(shape), "dtype": str(values.dtype),
                "truncated": truncate_size < shape[0], "values": values.tolist()}


def _transpose(x: Any) -> Any:
    return x.T if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x).T


def _stack(xs: Sequence[Any]) -> Any:
    if all(isinstance(x, jax.Array) for x in xs):
        return jnp.stack(xs)
    return np.stack([np.asarray(x) for x in xs])
