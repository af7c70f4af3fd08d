"""Memory release / resume of one engine: give the devices back (e.g. to an RL trainer on
the same chips), then take them again, without losing a request.

Owns `MemoryManager` (one per Engine): the host copy of released weights, the host copy
of preserved K/V pages, and whether the release paused the engine. Runs on the engine
thread only (commands between steps).

Tags: "weights" (the params) and "kv_cache" (the KV pool plus the engine's small step
buffers: the last sampled ids and the zero penalty arrays).

Invariants:
- Release first pauses the engine if it runs (mode as given, default retract) and
  drains: no step is in flight while a buffer is freed. While any tag is released the
  engine never steps (`EngineCore.has_work` is false), so no freed buffer is touched;
  new requests are accepted and wait.
- After releasing both tags, none of the engine's arrays is alive on its devices
  (freed buffers are deleted explicitly, not left to the garbage collector).
- Releasing "kv_cache" keeps every request: without `preserve_state`, requests holding
  K/V (paused in place) are retracted (they re-prefill on resume) and the prefix cache
  is emptied. With `preserve_state`, the pages those requests hold are copied to the
  host and written back, bit for bit, at the same page ids on resume (no allocation
  happens while released), so they continue exactly as if never interrupted; cached
  pages nobody holds are dropped.
- Releasing "weights" also frees a staged, unpublished weight update (weights.py); its
  hold on the engine becomes the release's pause.
- Resume restores weights before K/V. Generation continues when everything is resident
  again iff the release paused it. Release/resume of an already released/resident tag
  is a no-op that says so. Host copies are dropped as soon as they are uploaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from multiserve.engine.weights import WeightManager
from multiserve.model.kv_pool import make_kv_pool
from multiserve.model.sharding import kv_pool_sharding
from multiserve.types import ControlResult

TAGS: tuple[str, ...] = ("weights", "kv_cache")  # resume order: weights first


def normalize_tags(tags: Any) -> tuple[str, ...]:
    """Validated tags in TAGS order (ValueError names the bad one). None/empty: all."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = (tags,)
    tags = tuple(tags)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"tags: unknown tag {bad[0]!r}; known tags: {list(TAGS)}")
    return tuple(t for t in TAGS if t in tags) or TAGS


@dataclass
class _PreservedKV:
    pages: np.ndarray  # page ids, ascending
    k: np.ndarray  # [L, kv_heads, len(pages) * page_size, head_dim]
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _nbytes(tree: Any) -> int:
    return sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(tree))


class MemoryManager:
    def __init__(self, core: Any, weights: WeightManager) -> None:
        self.core = core
        self.weights = weights
        self.kv_sharding = kv_pool_sharding(core.model_cfg, core.runner.mesh)
        self.host_params: Any = None
        self.preserved: _PreservedKV | None = None
        self.paused_by_release = False

    @property
    def host_bytes(self) -> int:
        n = _nbytes(self.host_params) if self.host_params is not None else 0
        return n + (self.preserved.nbytes if self.preserved is not None else 0)

    # ---- release ---------------------------------------------------------------------------
    def release(self, tags: tuple[str, ...], mode: str, preserve_state: bool) -> ControlResult:
        core = self.core
        core.drain()
        newly = [t for t in tags if t not in core.released_tags]
        if not newly:
            return ControlResult(True, f"already released: {list(tags)} (no-op)", {
                "released": [], "memory_released": sorted(core.released_tags),
                "already_released": True})
        details: dict[str, Any] = {"released": newly}
        if not core.paused:
            details["pause"] = core.pause(mode).details
            self.paused_by_release = True
        if "kv_cache" in newly:
            details.update(self._release_kv(preserve_state))
        if "weights" in newly:
            dropped, held = self.weights.drop_staged()
            details["discarded_staged_weights"] = dropped
            self.paused_by_release = self.paused_by_release or held
            runner = core.runner
            leaves = jax.tree.leaves(runner.params)
            self.host_params = jax.tree.map(lambda a: np.array(a, copy=True), runner.params)
            for leaf in leaves:
                leaf.delete()
            runner.params = None
            details["weights_host_bytes"] = _nbytes(self.host_params)
        core.released_tags = core.released_tags | frozenset(newly)
        details["memory_released"] = sorted(core.released_tags)
        details["host_bytes"] = self.host_bytes
        return ControlResult(True, f"released {newly}; the engine is asleep", details)

    def _release_kv(self, preserve_state: bool) -> dict[str, Any]:
        core = self.core
        sched, cache, runner = core.scheduler, core.cache, core.runner
        holders = list(sched.running)
        out: dict[str, Any] = {}
        if preserve_state and holders:
            out["dropped_cached_pages"] = cache.evict(cache.num_evictable_pages)
            pages = np.asarray(sorted({p for r in holders for p in r.pages}), np.int64)
            ps = core.page_size
            slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
            kv = runner.kv
            self.preserved = _PreservedKV(pages, np.array(kv.k[:, :, slots], copy=True),
                                          np.array(kv.v[:, :, slots], copy=True))
            out["preserved_requests"] = len(holders)
            out["preserved_kv_pages"] = len(pages)
        else:
            if holders:
                sched.retract(holders)
                out["retracted"] = len(holders)
            self.weights.check_stale()
            out["dropped_cached_pages"] = cache.reset()
            self.preserved = None
        kv = runner.kv
        kv.k.delete()
        kv.v.delete()
        runner.kv = None
        runner.drop_step_buffers()
        sched.check_integrity()
        return out

    # ---- resume ----------------------------------------------------------------------------
    def resume(self, tags: tuple[str, ...]) -> ControlResult:
        core = self.core
        core.drain()
        todo = [t for t in TAGS if t in tags and t in core.released_tags]
        if not todo:
            return ControlResult(True, f"not released: {list(tags)} (no-op)", {
                "resumed": [], "memory_released": sorted(core.released_tags),
                "already_resident": True})
        runner = core.runner
        details: dict[str, Any] = {"resumed": todo, "host_bytes_freed": 0}
        if "weights" in todo:
            assert self.host_params is not None
            # (on CPU the device arrays may adopt the host copy's buffers: no 2nd copy)
            params = jax.device_put(self.host_params, self.weights.shardings)
            jax.block_until_ready(params)
            runner.params = params
            details["host_bytes_freed"] += _nbytes(self.host_params)
            self.host_params = None
            core.released_tags = core.released_tags - {"weights"}
        if "kv_cache" in todo:
            kv = make_kv_pool(core.model_cfg, runner.num_pages, core.page_size, runner.dtype,
                              sharding=self.kv_sharding)
            if self.preserved is not None:
                kv = self._restore(kv, self.preserved)
                details["restored_kv_pages"] = len(self.preserved.pages)
                details["host_bytes_freed"] += self.preserved.nbytes
                self.preserved = None
            runner.kv = kv
            runner.reset_prev_ids()
            core.released_tags = core.released_tags - {"kv_cache"}
        continued = False
        if not core.released_tags and self.paused_by_release:
            self.paused_by_release = False
            continued = core.paused
            core.paused = False
        details["continued"] = continued
        details["memory_released"] = sorted(core.released_tags)
        asleep = "; still asleep" if core.released_tags else ""
        return ControlResult(True, f"resumed {todo}{asleep}", details)

    def _restore(self, kv: Any, saved: _PreservedKV) -> Any:
        ps = self.core.page_size
        slots = (saved.pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
        replicated = self.core.runner.replicated
        slots_dev = jax.device_put(slots, replicated)
        k, v = jax.device_put((saved.k, saved.v), self.kv_sharding)
        sh = self.kv_sharding

        def put(pool_k: jax.Array, pool_v: jax.Array, s: jax.Array, nk: jax.Array,
                nv: jax.Array) -> tuple[jax.Array, jax.Array]:
            return pool_k.at[:, :, s].set(nk), pool_v.at[:, :, s].set(nv)

        fn = jax.jit(put, donate_argnums=(0, 1), out_shardings=(sh, sh))
        new_k, new_v = fn(kv.k, kv.v, slots_dev, k, v)
        return type(kv)(k=new_k, v=new_v)

    def read_host_params(self) -> Any:
        return self.host_params
