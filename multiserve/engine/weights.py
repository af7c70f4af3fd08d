"""Weight updates of one engine: validate, stage, publish atomically, read back.

Owns `WeightManager` (one per Engine): the target layout of the engine's params (shape,
dtype and sharding of every leaf, fixed at start-up), the one pending staged update, and
the prefix-cache consequences of a publish.

Flow: `begin()` (engine thread: may the engine take an update now? hold it paused) ->
`stage_*()` (caller thread: read, validate every tensor, cast, place on the engine's
devices: a COPY, never an alias of the caller's arrays) -> `publish()` (engine thread,
between steps: swap params, set the version, invalidate the prefix cache) or `discard()`.

Invariants:
- Validation finishes before any device buffer is created; a failure in validation or
  staging leaves the live params, the version and the cache untouched (nothing changes).
- Staged leaves have exactly the live leaves' shape, dtype and sharding, so the jitted
  step never recompiles after a publish (`cache_miss_count` is unchanged).
- At most one staged update per engine; staging again replaces (discards) the previous.
- Cached K/V belongs to the weights that produced it. On publish every unreferenced
  prefix-cache page is dropped. Requests that still hold K/V (paused `in_place`) keep it
  and continue decoding with the new weights from that K/V (their weight segments say
  where the version changed); while any of them lives the prefix cache is switched off,
  so K/V computed with the old weights is never matched by another request. When the
  last of them finishes, the cache is cleared and switched back on. Retracted and
  waiting requests hold no K/V: they re-prefill with the new weights.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from multiserve.engine.request import Req
from multiserve.model import safetensors_io
from multiserve.model.errors import ModelLoadError
from multiserve.model.hf_names import HfTensorSpec, hf_tensor_specs
from multiserve.model.param_layout import param_shapes
from multiserve.model.sharding import param_shardings
from multiserve.types import ControlResult

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json fields that must agree with the serving model for a disk update
_CONFIG_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                  "num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                  "rope_theta", "rms_norm_eps")


class WeightUpdateError(ValueError):
    """An update was refused or is invalid; the message names the tensor or the reason."""


LeafPath = tuple[str, ...]  # ("embed",) or ("layers", "wq")


@dataclass
class StagedWeights:
    token: str
    weight_version: str
    full: dict[LeafPath, jax.Array] = field(default_factory=dict)  # whole new leaves
    # stacked leaves updated for some layers only: path -> (layer indexes, [k, ...] values)
    partial: dict[LeafPath, tuple[np.ndarray, jax.Array]] = field(default_factory=dict)
    names: int = 0  # tensors given
    source: str = "<tensors>"

    def arrays(self) -> list[jax.Array]:
        return list(self.full.values()) + [v for _, v in self.partial.values()]

    def delete(self) -> None:
        for a in self.arrays():
            a.delete()
        self.full.clear()
        self.partial.clear()


def _get(tree: Mapping[str, Any], path: LeafPath) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict[str, Any], path: LeafPath, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _leaf_paths(shapes: Mapping[str, Any]) -> list[LeafPath]:
    out: list[LeafPath] = []
    for k, v in shapes.items():
        if isinstance(v, Mapping):
            out += [(k, kk) for kk in v]
        else:
            out.append((k,))
    return out


def _check_dtype(name: str, x: Any, where: str = "") -> None:
    dt = np.dtype(x.dtype)
    if not (np.issubdtype(dt, np.floating) or dt == np.dtype(ml_dtypes.bfloat16)):
        raise WeightUpdateError(f"{where}tensor {name!r}: dtype {dt} is not a floating-point "
                                "type")


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_finite(name: str, x: Any, where: str = "") -> None:
    ok = bool(_all_finite(x)) if isinstance(x, jax.Array) else bool(
        np.isfinite(np.asarray(x)).all())
    if not ok:
        raise WeightUpdateError(f"{where}tensor {name!r}: has NaN or inf values")


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


class WeightManager:
    """Weight updates for one engine (see module docstring). `core` is its EngineCore."""

    def __init__(self, core: Any) -> None:
        self.core = core
        runner = core.runner
        self.model_cfg = core.model_cfg
        self.dtype = np.dtype(runner.dtype)
        self.shapes = param_shapes(self.model_cfg)
        self.shardings = param_shardings(self.model_cfg, runner.mesh)
        self.paths = _leaf_paths(self.shapes)
        self.specs: dict[str, HfTensorSpec] = hf_tensor_specs(self.model_cfg)
        for path in self.paths:  # the live params must have exactly this layout
            leaf = _get(runner.params, path)
            assert tuple(leaf.shape) == _get(self.shapes, path), path
            assert leaf.dtype == self.dtype and leaf.sharding == _get(self.shardings, path), path
        self._lock = threading.Lock()
        self._staged: StagedWeights | None = None
        self._held: str | None = None  # token whose staging paused the engine
        self._stale: dict[tuple[str, int], tuple[Req, int]] = {}
        self.cache_enabled_by_config = core.cache.enabled
        self.num_updates = 0

    # ---- engine thread: may an update happen now? -------------------------------------
    def begin(self, abort_running: bool) -> ControlResult:
        """Refuse if the update could not be published now; otherwise hold the engine (a
        pause that moves nothing) so the publish cannot be refused for new requests."""
        core = self.core
        core.drain()
        if "weights" in core.released_tags:
            return ControlResult(False, "weights are released: resume_memory_occupation("
                                 "tags=['weights']) before updating them",
                                 {"refused": "weights_released"})
        live = len(core.reqs)
        if live and not core.paused and not abort_running:
            return ControlResult(False, f"cannot update weights while {live} request(s) are "
                                 "running: pause_generation (retract or in_place) first, or "
                                 "pass abort_running=true", {"refused": "running", "live": live})
        token = uuid.uuid4().hex
        with self._lock:
            if self._staged is not None:
                self._staged.delete()
                self._staged = None
            if self._held is None and not core.paused:
                core.paused = True  # nothing is running (or it is aborted at publish)
                self._held = token
            elif self._held is not None:
                self._held = token
        return ControlResult(True, "ready to stage", {"token": token})

    # ---- caller thread: validate + stage ---------------------------------------------------
    def stage(self, token: str, tensors: Any, weight_version: str, *, require_all: bool,
              source: str = "<tensors>") -> StagedWeights:
        """Validate `tensors` (flat HF-name dict / pairs, or our params pytree), then copy
        them onto the engine's devices. Raises WeightUpdateError naming the tensor."""
        if not isinstance(weight_version, str) or not weight_version:
            raise WeightUpdateError("weight_version: must be a non-empty string")
        if isinstance(tensors, Mapping) and set(tensors) and set(tensors) <= set(self.shapes):
            full, partial, n = self._validate_tree(tensors, require_all), {}, 0
            n = len(full)
        else:
            named = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
            full, partial, n = self._validate_named(named, require_all, source)
        staged = StagedWeights(token, weight_version, names=n, source=source)
        try:
            for path, x in full.items():
                staged.full[path] = self._place(x, _get(self.shardings, path))
            for path, (idx, vals) in partial.items():
                sh = _get(self.shardings, path)
                staged.partial[path] = (idx, self._place(vals, sh))
            bad = [p for p, a in list(staged.full.items()) + [
                (p, v) for p, (_, v) in staged.partial.items()] if not bool(_all_finite(a))]
            if bad:
                raise WeightUpdateError(f"tensor {'/'.join(bad[0])!r}: has NaN or inf values "
                                        f"(after the cast to {self.dtype})")
        except BaseException:
            staged.delete()
            raise
        with self._lock:
            if self._staged is not None:
                self._staged.delete()
            self._staged = staged
        return staged

    def _place(self, x: Any, sharding: Any) -> jax.Array:
        if isinstance(x, jax.Array):
            y = x.astype(self.dtype) if x.dtype != self.dtype else x
            return jax.device_put(y, sharding, may_alias=False)
        # A private copy: on CPU, device_put adopts aligned numpy buffers even with
        # may_alias=False, and the caller may mutate (or overwrite the file of) its arrays.
        arr = np.array(x, dtype=self.dtype, copy=True)
        return jax.device_put(arr, sharding)

    def _validate_tree(self, tree: Mapping[str, Any], require_all: bool
                       ) -> dict[LeafPath, Any]:
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
            want = _get(self.shapes, path)
            if tuple(x.shape) != tuple(want):
                raise WeightUpdateError(f"tensor {name!r}: shape {tuple(x.shape)}, expected "
                                        f"{tuple(want)}")
            _check_dtype(name, x)
            _check_finite(name, x)
        return out

    def _validate_named(self, named: dict[str, Any], require_all: bool, source: str
                        ) -> tuple[dict[LeafPath, Any], dict[LeafPath, tuple[np.ndarray, Any]],
                                   int]:
        where = "" if source == "<tensors>" else f"{source}: "
        cfg = self.model_cfg
        given: dict[str, Any] = {}
        for name, x in named.items():
            if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings
                                                    and name == "lm_head.weight"):
                continue
            spec = self.specs.get(name)
            if spec is None:
                raise WeightUpdateError(f"{where}tensor {name!r}: not a parameter of this "
                                        f"{cfg.architecture} model")
            if not _is_array(x):
                raise WeightUpdateError(f"{where}tensor {name!r}: not an array "
                                        f"({type(x).__name__})")
            if tuple(x.shape) != spec.hf_shape:
                raise WeightUpdateError(f"{where}tensor {name!r}: shape {tuple(x.shape)}, "
                                        f"expected {spec.hf_shape}")
            _check_dtype(name, x, where)
            _check_finite(name, x, where)
            given[name] = x
        if require_all:
            missing = [n for n in self.specs if n not in given]
            if missing:
                raise WeightUpdateError(f"{where}tensor {missing[0]!r}: missing "
                                        f"({len(missing)} missing in all)")
        if not given:
            raise WeightUpdateError(f"{where}no tensor to update")
        # group per leaf: whole leaves, or a subset of a stacked leaf's layers
        by_leaf: dict[LeafPath, dict[int | None, Any]] = {}
        for name, x in given.items():
            spec = self.specs[name]
            path = (spec.key,) if spec.layer is None else ("layers", spec.key)
            xt = _transpose(x) if spec.transposed else x
            by_leaf.setdefault(path, {})[spec.layer] = xt
        full: dict[LeafPath, Any] = {}
        partial: dict[LeafPath, tuple[np.ndarray, Any]] = {}
        for path, parts in by_leaf.items():
            if None in parts:
                full[path] = parts[None]
                continue
            layers = sorted(parts)
            stacked = _stack([parts[i] for i in layers])
            if len(layers) == cfg.num_layers:
                full[path] = stacked
            else:
                partial[path] = (np.asarray(layers, np.int32), stacked)
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
        from multiserve.model.hf_loader import load_hf_config

        try:
            theirs = load_hf_config(model_dir)
        except ModelLoadError as e:
            raise WeightUpdateError(str(e)) from e
        for f in _CONFIG_FIELDS:
            a, b = getattr(theirs, f), getattr(self.model_cfg, f)
            if a != b:
                raise WeightUpdateError(f"{cfg_file}: {f} is {a!r} but the served model has "
                                        f"{b!r}")

    # ---- engine thread: publish / discard --------------------------------------------------
    def publish(self, token: str, abort_running: bool) -> ControlResult:
        core = self.core
        core.drain()
        with self._lock:
            staged = self._staged
        if staged is None or staged.token != token:
            return ControlResult(False, f"no staged weights with token {token!r} (never "
                                 "staged, already published, discarded or replaced)",
                                 {"refused": "unknown_token"})
        if "weights" in core.released_tags:
            return ControlResult(False, "weights are released: resume them, then publish",
                                 {"refused": "weights_released", "token": token})
        live = len(core.reqs)
        if live and not core.paused and not abort_running:
            return ControlResult(False, f"cannot publish weights while {live} request(s) are "
                                 "running: pause first or pass abort_running=true",
                                 {"refused": "running", "live": live, "token": token})
        runner = core.runner
        # Build the whole new tree first; only then swap (nothing changes on failure).
        new = jax.tree.map(lambda a: a, runner.params)
        replaced: list[jax.Array] = []
        for path, arr in staged.full.items():
            replaced.append(_get(runner.params, path))
            _set(new, path, arr)
        for path, (idx, vals) in staged.partial.items():
            old = _get(runner.params, path)
            idx_dev = jax.device_put(idx, runner.replicated)
            merged = _scatter_layers(old, idx_dev, vals, old.sharding)
            replaced.append(old)
            _set(new, path, merged)
        for path in self.paths:
            leaf = _get(new, path)
            assert leaf.sharding == _get(self.shardings, path) and leaf.dtype == self.dtype
        aborted = 0
        if abort_running and live:
            aborted = core.abort(None, abort_all=True).details.get("aborted", 0)
        previous = core.weight_version
        runner.params = new
        core.weight_version = staged.weight_version
        for _, vals in staged.partial.values():
            vals.delete()
        for a in replaced:
            a.delete()  # nothing else holds the engine's old params (staging copies)
        with self._lock:
            self._staged = None
        cache = self._invalidate_cache()
        resumed = self._release_hold()
        self.num_updates += 1
        return ControlResult(True, f"weights updated to version {staged.weight_version!r}", {
            "weight_version": staged.weight_version, "previous_weight_version": previous,
            "tensors": staged.names, "source": staged.source, "aborted": aborted,
            "continued": resumed, **cache})

    def discard(self, token: str | None) -> ControlResult:
        with self._lock:
            staged = self._staged
            if staged is None or (token is not None and staged.token != token):
                resumed = self._release_hold() if token is None or token == self._held else False
                return ControlResult(True, "nothing staged (no-op)",
                                     {"discarded": False, "continued": resumed})
            self._staged = None
        staged.delete()
        return ControlResult(True, f"discarded staged weights {staged.weight_version!r}",
                             {"discarded": True, "token": staged.token,
                              "continued": self._release_hold()})

    def release_hold_if(self, token: str) -> None:
        """Undo begin()'s hold when staging failed (engine thread)."""
        if self._held == token and (self._staged is None or self._staged.token != token):
            self._release_hold()

    def drop_staged(self) -> int:
        """Memory release: free the staged device copy (its token becomes invalid)."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return 0
        staged.delete()
        return 1

    def _release_hold(self) -> bool:
        if self._held is None:
            return False
        self._held = None
        if self.core.paused:
            self.core.paused = False
            return True
        return False

    @property
    def staged_version(self) -> str | None:
        s = self._staged
        return None if s is None else s.weight_version

    # ---- prefix cache after a publish (engine thread) ---------------------------------------
    def _invalidate_cache(self) -> dict[str, Any]:
        core = self.core
        cache = core.cache
        dropped = cache.evict(cache.num_evictable_pages)
        holders = [r for r in core.reqs.values() if r.pages]
        for r in holders:
            if r.key not in self._stale:
                self._stale[r.key] = (r, r.num_retractions)
                r.sink = self._watch(r.sink)
        self.check_stale()
        return {"flushed_cached_pages": dropped,
                "kept_kv_requests": len(holders),
                "prefix_cache_enabled": cache.enabled}

    def _watch(self, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        def watched(out: Any) -> None:
            if out.finished:
                self.check_stale()
            sink(out)
        return watched

    def check_stale(self) -> None:
        """Cache off while a request still holds K/V of replaced weights; on again (and
        emptied) once none does."""
        cache = self.core.cache
        live = {k: v for k, v in self._stale.items()
                if not v[0].finished and v[0].num_retractions == v[1]}
        self._stale = live
        if live:
            cache.enabled = False
            return
        if cache.num_referenced_pages == 0:
            cache.reset()
            cache.enabled = self.cache_enabled_by_config

    # ---- reading weights back -----------------------------------------------------------------
    def read(self, params: Any, name: str, truncate_size: int) -> dict[str, Any]:
        """The first `truncate_size` rows (dim 0) of tensor `name` (HF name, HF
        orientation; or a pytree path like "embed" / "layers/wq") from `params` (device
        or host pytree)."""
        spec = self.specs.get(name)
        if spec is not None:
            path = (spec.key,) if spec.layer is None else ("layers", spec.key)
            leaf = _get(params, path)
            x = leaf if spec.layer is None else leaf[spec.layer]
            shape = spec.hf_shape
            x = x[:, :truncate_size].T if spec.transposed else x[:truncate_size]
        else:
            path = tuple(p for p in name.replace(".", "/").split("/") if p)
            try:
                leaf = _get(params, path)
            except (KeyError, TypeError):
                raise WeightUpdateError(f"tensor {name!r}: not a parameter of this model "
                                        "(give an HF name such as "
                                        "'model.layers.0.self_attn.q_proj.weight')") from None
            if isinstance(leaf, Mapping):
                raise WeightUpdateError(f"tensor {name!r}: names a group, not a tensor")
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


def _scatter_layers(old: jax.Array, idx: jax.Array, vals: jax.Array, sharding: Any
                    ) -> jax.Array:
    fn = jax.jit(lambda a, i, v: a.at[i].set(v), out_shardings=sharding)
    return fn(old, idx, vals)
