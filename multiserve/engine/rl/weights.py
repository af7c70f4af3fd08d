"""Weight updates of one engine: validate, stage, publish atomically, read back.

Owns `WeightManager` (one per Engine): the target layout of the engine's params (shape,
dtype and sharding of every leaf, fixed at start-up), the one pending staged update, and
the "weights_staged" pause reason. Validation and disk reading live in `checks.py`.

Flow: `begin()` (engine thread: may the engine take an update now? hold it) ->
`stage()` (caller thread: read, validate every tensor, cast, place on the engine's
devices: a COPY, never an alias of the caller's arrays) -> `publish()` (engine thread,
between steps: `core.swap_params`, then `core.set_weight_version`, which invalidates the
K/V of the old weights) or `discard()`. The engine core is touched only through its
narrow methods (hold/release_hold, swap_params, set_weight_version, abort, drain).
Tensors wrapped in `DeviceArrays` (an in-process trainer's jax.Arrays) are staged
strictly: each must be a jax.Array of exactly the served dtype, is copied device to device
onto the engine's sharding, and no value is read.

Invariants:
- Validation finishes before any device buffer is created; a failure in validation or
  staging leaves the live params, the version and the cache untouched (nothing changes).
- Staging `DeviceArrays` transfers nothing to or from the host and casts nothing: the
  staged leaves are the given values bit for bit (a transpose/stack of HF-named tensors
  runs on the devices; NaN/inf are not checked, as that would read values back).
- Staged leaves have exactly the live leaves' shape, dtype and sharding, so the jitted
  step never recompiles after a publish (`cache_miss_count` is unchanged).
- At most one staged update per engine; staging again replaces (discards) the previous.
- The engine is held (pause reason "weights_staged") from `begin()` until publish,
  discard, a failed staging, or a memory release of the weights; a user pause is
  separate and survives all of them.
- Cached K/V belongs to the weights that produced it. On publish every unreferenced
  prefix-cache page is dropped. Requests that still hold K/V (paused `in_place`) keep it
  and continue decoding with the new weights from that K/V (their weight segments say
  where the version changed); while any of them holds it the prefix cache is suspended,
  so K/V computed with the old weights is never matched by another request
  (Scheduler.invalidate_kv). Retracted and waiting requests hold no K/V: they re-prefill
  with the new weights.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from multiserve.engine.rl.checks import ParamLayout, WeightUpdateError, finite_each
from multiserve.model.param_tree import LeafPath, get_leaf, with_leaves
from multiserve.model.sharding import param_shardings
from multiserve.types import ControlResult

if TYPE_CHECKING:
    from multiserve.engine.rl_interface import RLInterface

__all__ = ["DeviceArrays", "StagedWeights", "WeightManager", "WeightUpdateError"]


@dataclass(frozen=True, eq=False)
class DeviceArrays:
    """Tensors (flat {HF name: jax.Array}, pairs, or the params pytree) to stage strictly:
    device arrays of the served dtype, moved device to device, no value read back."""
    tensors: Any


@dataclass
class StagedWeights:
    token: str
    weight_version: str
    full: dict[LeafPath, jax.Array] = field(default_factory=dict)  # whole new leaves
    # stacked leaves updated for some layers (or some experts of some layers) only:
    # path -> (layer indexes [k] or (layer, expert) pairs [k, 2], [k, ...] values)
    partial: dict[LeafPath, tuple[np.ndarray, jax.Array]] = field(default_factory=dict)
    names: int = 0  # tensors given
    source: str = "<tensors>"

    def arrays(self) -> list[jax.Array]:
        return list(self.full.values()) + [v for _, v in self.partial.values()]

    def delete(self) -> None:
        for a in self.arrays():
            if isinstance(a, jax.Array):  # an engine spanning hosts stages host copies
                a.delete()
        self.full.clear()
        self.partial.clear()


class WeightManager:
    """Weight updates for one engine (see module docstring). `core` is its RLInterface."""

    def __init__(self, core: RLInterface) -> None:
        self.core = core
        runner = core.runner  # read for its fixed settings only (dtype, mesh)
        self.model_cfg = core.model_cfg
        self.dtype = np.dtype(runner.dtype)
        self.replicated = runner.replicated
        self.layout = ParamLayout(self.model_cfg)
        self.shapes, self.paths = self.layout.shapes, self.layout.paths
        self.shardings = param_shardings(self.model_cfg, runner.mesh, runner.cfg.moe_sharding)
        for path in self.paths:  # the live params must have exactly this layout
            leaf = get_leaf(core.param_specs, path)
            assert tuple(leaf.shape) == get_leaf(self.shapes, path), path
            assert leaf.dtype == self.dtype, path
            assert leaf.sharding == get_leaf(self.shardings, path), path
        self._lock = threading.Lock()
        self._staged: StagedWeights | None = None
        self._held: str | None = None  # token of the staging that holds the engine
        self._token: str | None = None  # the latest begin(); staging for another is stale
        # an engine spanning hosts (multiserve/multihost/) stages host copies: its leader
        # holds only its own shards, and every host places the same host values at publish
        self.on_host = runner.mirror is not None

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
        live = core.num_live
        if live and not core.paused and not abort_running:
            return ControlResult(False, f"cannot update weights while {live} request(s) are "
                                 "running: pause_generation (retract or in_place) first, or "
                                 "pass abort_running=true", {"refused": "running", "live": live})
        aborted = 0
        if abort_running and live:  # sglang's abort_all_requests: abort first, then load
            aborted = core.abort_all()
        token = uuid.uuid4().hex
        with self._lock:
            self._token = token
            if self._staged is not None:
                self._staged.delete()
                self._staged = None
            self._held = token
        core.hold("weights_staged")  # nothing runs (or it is aborted at publish)
        return ControlResult(True, "ready to stage", {"token": token, "aborted": aborted})

    # ---- caller thread: validate + stage ---------------------------------------------------
    def stage(self, token: str, tensors: Any, weight_version: str, *, require_all: bool,
              source: str = "<tensors>") -> StagedWeights:
        """Validate `tensors` (flat HF-name dict / pairs, or our params pytree), then copy
        them onto the engine's devices. Raises WeightUpdateError naming the tensor."""
        if not isinstance(weight_version, str) or not weight_version:
            raise WeightUpdateError("weight_version: must be a non-empty string")
        device_only = isinstance(tensors, DeviceArrays)
        if device_only:
            tensors = tensors.tensors
            if not isinstance(tensors, Mapping):
                tensors = dict(tensors)
            self._check_device_arrays(tensors)
        if self.on_host and device_only:
            raise WeightUpdateError("an engine spanning hosts takes host arrays only (each "
                                    "host places its own shards of the same values)")
        full, partial, n = self.layout.validate(tensors, require_all, source,
                                                check_finite=not device_only)
        if self.on_host and partial:
            raise WeightUpdateError(f"tensor {'/'.join(next(iter(partial)))!r}: an engine "
                                    "spanning hosts updates whole tensors only (not some "
                                    "layers of a stacked one)")
        staged = StagedWeights(token, weight_version, names=n, source=source)
        try:
            for path, x in full.items():
                staged.full[path] = self._place(x, get_leaf(self.shardings, path))
            for path, (idx, vals) in partial.items():
                sh = get_leaf(self.shardings, path)
                staged.partial[path] = (idx, self._place(vals, sh))
            placed = list(staged.full.items()) + [
                (p, v) for p, (_, v) in staged.partial.items()]
            bad = [] if device_only or self.on_host else [
                p for (p, _), ok in zip(placed, finite_each([a for _, a in placed]))
                if not ok]
            if bad:
                raise WeightUpdateError(f"tensor {'/'.join(bad[0])!r}: has NaN or inf values "
                                        f"(after the cast to {self.dtype})")
        except BaseException:
            staged.delete()
            raise
        with self._lock:
            if self._token != token:  # released, discarded or superseded meanwhile
                staged.delete()
                raise WeightUpdateError(f"staging of {weight_version!r} was cancelled (memory "
                                        "released, discarded, or a newer update began)")
            if self._staged is not None:
                self._staged.delete()
            self._staged = staged
        return staged

    def _check_device_arrays(self, tensors: Mapping[str, Any]) -> None:
        for name, x in _named_leaves(tensors):
            if not isinstance(x, jax.Array):
                raise WeightUpdateError(f"tensor {name!r}: not a jax.Array ({type(x).__name__}"
                                        "): update_weights_from_tensor takes host arrays")
            if x.dtype != self.dtype:
                raise WeightUpdateError(f"tensor {name!r}: dtype {x.dtype}, the engine serves "
                                        f"{self.dtype} (arrays are never cast here)")

    def _place(self, x: Any, sharding: Any) -> jax.Array:
        if self.on_host:  # a private host copy, placed at publish (Runner.replace_leaves)
            return np.array(x, dtype=self.dtype, copy=True)  # type: ignore[return-value]
        if isinstance(x, jax.Array):
            y = x.astype(self.dtype) if x.dtype != self.dtype else x
            return jax.device_put(y, sharding, may_alias=False)
        # A private copy: on CPU, device_put adopts aligned numpy buffers even with
        # may_alias=False, and the caller may mutate (or overwrite the file of) its arrays.
        # A value out of the dtype's range becomes inf, which the check after placing
        # reports as the update's error (no numpy warning besides).
        with np.errstate(over="ignore"):
            arr = np.array(x, dtype=self.dtype, copy=True)
        return jax.device_put(arr, sharding)

    # ---- engine thread: publish / discard --------------------------------------------------
    def has_staged(self, token: str) -> bool:
        with self._lock:
            return self._staged is not None and self._staged.token == token

    def publish(self, token: str, abort_running: bool, weight_version: str | None = None
                ) -> ControlResult:
        """Swap the staged weights `token` in; `weight_version` (if given) replaces the
        version they were staged with (a session names it at its finish)."""
        core = self.core
        core.drain()
        with self._lock:
            staged = self._staged
        if staged is None or staged.token != token:
            return ControlResult(False, f"no staged weights with token {token!r} (never "
                                 "staged, already published, discarded or replaced)",
                                 {"refused": "unknown_token"})
        if weight_version is not None:
            staged.weight_version = weight_version
        if "weights" in core.released_tags:
            return ControlResult(False, "weights are released: resume them, then publish",
                                 {"refused": "weights_released", "token": token})
        live = core.num_live
        if live and not core.paused and not abort_running:
            return ControlResult(False, f"cannot publish weights while {live} request(s) are "
                                 "running: pause first or pass abort_running=true",
                                 {"refused": "running", "live": live, "token": token})
        if self.on_host:
            return self._publish_from_host(staged, abort_running, live)
        def new_leaf(path: LeafPath, old: jax.Array) -> jax.Array:
            if path in staged.full:
                return staged.full[path]
            idx, vals = staged.partial[path]
            return _scatter_layers(old, jax.device_put(idx, self.replicated), vals,
                                   old.sharding)

        # Build the whole new tree first; only then swap (nothing changes on failure).
        new, replaced = with_leaves(core.params, [*staged.full, *staged.partial], new_leaf)
        for path in self.paths:
            leaf = get_leaf(new, path)
            assert leaf.sharding == get_leaf(self.shardings, path) and leaf.dtype == self.dtype
        aborted = 0
        if abort_running and live:
            # what runs on the old weights (it arrived, or was continued, while staging);
            # requests that only waited run on the new weights, as in sglang
            aborted = core.abort_started()
        previous = core.weight_version
        core.swap_params(new)
        for _, vals in staged.partial.values():
            vals.delete()
        for a in replaced:
            a.delete()  # nothing else holds the engine's old params (staging copies)
        return self._published(staged, previous, aborted)

    def _publish_from_host(self, staged: StagedWeights, abort_running: bool,
                           live: int) -> ControlResult:
        """`publish` on an engine spanning hosts: every host places the staged host values
        (Runner.replace_leaves, streamed to the followers in order with the steps)."""
        core = self.core
        aborted = core.abort_started() if abort_running and live else 0
        previous = core.weight_version
        core.replace_param_leaves(dict(staged.full))
        return self._published(staged, previous, aborted)

    def _published(self, staged: StagedWeights, previous: str, aborted: int
                   ) -> ControlResult:
        """The end of either publish: the staging slot emptied, the new version set (the
        prefix cache follows it), a held pause released, and the answer."""
        with self._lock:
            self._staged = None
        cache = self.core.set_weight_version(staged.weight_version)
        resumed = self._release_hold()
        return ControlResult(True, f"weights updated to version {staged.weight_version!r}", {
            "weight_version": staged.weight_version, "previous_weight_version": previous,
            "tensors": staged.names, "source": staged.source, "aborted": aborted,
            "released_hold": resumed, **cache})

    def discard(self, token: str | None) -> ControlResult:
        with self._lock:
            if token is None or token == self._token:
                self._token = None
            staged = self._staged
            if staged is None or (token is not None and staged.token != token):
                resumed = self._release_hold() if token is None or token == self._held else False
                return ControlResult(True, "nothing staged (no-op)",
                                     {"discarded": False, "released_hold": resumed})
            self._staged = None
        staged.delete()
        return ControlResult(True, f"discarded staged weights {staged.weight_version!r}",
                             {"discarded": True, "token": staged.token,
                              "released_hold": self._release_hold()})

    def release_hold_if(self, token: str) -> None:
        """Undo begin()'s hold when staging failed (engine thread)."""
        if self._held == token and (self._staged is None or self._staged.token != token):
            self._release_hold()

    def drop_staged(self) -> bool:
        """Memory release of the weights: free the staged device copy (its token becomes
        invalid) and end begin()'s hold (the release holds the engine by then). Returns
        whether a staged copy was dropped."""
        with self._lock:
            staged, self._staged = self._staged, None
            self._token = None
        self._release_hold()
        if staged is not None:
            staged.delete()
        return staged is not None

    def _release_hold(self) -> bool:
        """End begin()'s hold; True iff the engine runs again now."""
        if self._held is None:
            return False
        self._held = None
        return self.core.release_hold("weights_staged")


def _named_leaves(tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, value) of a flat {name: array} dict or of the params pytree (one level of
    nesting: "layers/wq")."""
    for name, x in tensors.items():
        if isinstance(x, Mapping):
            for sub, y in x.items():
                yield f"{name}/{sub}", y
        else:
            yield str(name), x


def _scatter_layers(old: jax.Array, idx: jax.Array, vals: jax.Array, sharding: Any
                    ) -> jax.Array:
    """old with vals written at idx: [n] layer indexes, or [n, 2] (layer, expert) pairs."""
    def put(a: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
        return a.at[i].set(v) if i.ndim == 1 else a.at[i[:, 0], i[:, 1]].set(v)

    return jax.jit(put, out_shardings=sharding)(old, idx, vals)
