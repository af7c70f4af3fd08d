"""Memory release / resume of one engine: give the devices back (e.g. to an RL trainer on
the same chips), then take them again, without losing a request.

Owns `MemoryManager` (one per Engine): the host copy of released weights, the host copy
of preserved K/V pages, and the "memory_released" pause reason. Runs on the engine
thread only (commands between steps). Which tags are released is not stored here: it is
what the runner lacks (`RLInterface.released_tags`). The engine is touched only through
the core's narrow methods (hold/release_hold, swap_params, drop_kv/install_kv), the
scheduler's (retract, drop_cached_kv, check_integrity) and the prefix cache's reset.

Tags: "weights" (the params) and "kv_cache" (the KV pool plus the engine's small step
buffers: the last sampled ids and the zero penalty arrays).

Invariants:
- Release first holds the engine (pause reason "memory_released"; the mode as given,
  default retract, applies iff the engine was running) and drains: no step is in flight
  while a buffer is freed. While any tag is released the hold stays, so the engine never
  steps and no freed buffer is touched; new requests are accepted and wait.
- After releasing both tags, none of the engine's arrays is alive on its devices
  (freed buffers are deleted explicitly, not left to the garbage collector).
- Releasing "kv_cache" keeps every request: without `preserve_state`, requests holding
  K/V (paused in place) are retracted (they re-prefill on resume) and the prefix cache
  is emptied. With `preserve_state`, the pages those requests hold are copied to the
  host and written back, bit for bit, at the same page ids on resume (no allocation
  happens while released), so they continue exactly as if never interrupted; cached
  pages nobody holds are dropped.
- Releasing "weights" also frees a staged, unpublished weight update (rl/weights.py) and
  ends its hold (the release's hold remains).
- Resume restores weights before K/V. Once everything is resident again the release's
  hold ends; generation continues iff no other reason (a user pause, a staged update)
  holds the engine. Release/resume of an already released/resident tag
  is a no-op that says so. Host copies are dropped as soon as they are uploaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from multiserve.engine.rl.weights import WeightManager
from multiserve.model.layers.kv_pool import KVPool, make_kv_pool, read_slots, write_slots
from multiserve.model.param_tree import LeafPath, get_leaf
from multiserve.model.sharding import kv_pool_sharding
from multiserve.types import MEMORY_TAGS, ControlResult

if TYPE_CHECKING:
    from multiserve.engine.rl_interface import RLInterface


@dataclass
class _PreservedKV:
    pages: np.ndarray  # page ids, ascending
    k: np.ndarray  # every layer's (and head's) slots of the pages (kv_pool.read_slots)
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _nbytes(tree: Any) -> int:
    return sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(tree))


class MemoryManager:
    def __init__(self, core: RLInterface, weights: WeightManager) -> None:
        self.core = core
        self.weights = weights
        runner = core.runner  # read for its fixed settings only
        self.kv_layout = runner.kv_layout
        self.kv_sharding = kv_pool_sharding(core.model_cfg, runner.mesh, self.kv_layout)
        self.replicated = runner.replicated
        self.num_pages, self.dtype = runner.num_pages, runner.dtype
        self.host_params: Any = None
        self.preserved: _PreservedKV | None = None

    @property
    def host_bytes(self) -> int:
        n = _nbytes(self.host_params) if self.host_params is not None else 0
        return n + (self.preserved.nbytes if self.preserved is not None else 0)

    # ---- release ---------------------------------------------------------------------------
    def release(self, tags: tuple[str, ...], mode: str, preserve_state: bool) -> ControlResult:
        core = self.core
        if core.runner.mirror is not None:
            return ControlResult(False, "memory release is not supported on an engine "
                                 "spanning hosts (its leader cannot read the other hosts' "
                                 "shards back)", {"refused": "spans_hosts"})
        core.drain()
        newly = [t for t in tags if t not in core.released_tags]
        if not newly:
            return ControlResult(True, f"already released: {list(tags)} (no-op)", {
                "released": [], "memory_released": sorted(core.released_tags),
                "already_released": True})
        details: dict[str, Any] = {"released": newly}
        applied = core.hold("memory_released", mode)  # the mode applies iff it was running
        if applied is not None:
            details["pause"] = applied
        if "kv_cache" in newly:
            details.update(self._release_kv(preserve_state))
        if "weights" in newly:
            details["discarded_staged_weights"] = self.weights.drop_staged()
            self.host_params = jax.tree.map(lambda a: np.array(a, copy=True), core.params)
            for leaf in jax.tree.leaves(core.swap_params(None)):  # the held leaves
                leaf.delete()
            details["weights_host_bytes"] = _nbytes(self.host_params)
        details["memory_released"] = sorted(core.released_tags)
        details["host_bytes"] = self.host_bytes
        return ControlResult(True, f"released {newly}; the engine is asleep", details)

    def _release_kv(self, preserve_state: bool) -> dict[str, Any]:
        core = self.core
        held = core.running_pages()
        out: dict[str, Any] = {}
        if preserve_state and held.requests:
            out["dropped_cached_pages"] = core.drop_cached_kv()
            pages = np.asarray(held.pages, np.int64)
            ps = core.page_size
            slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
            kv = core.kv_pool
            assert kv is not None
            self.preserved = _PreservedKV(pages, read_slots(kv.k, kv.layout, slots),
                                          read_slots(kv.v, kv.layout, slots))
            out["preserved_requests"] = held.requests
            out["preserved_kv_pages"] = len(pages)
        else:
            if held.requests:
                out["retracted"] = core.retract_running()
            out["dropped_cached_pages"] = core.reset_prefix_cache()  # no page is held now
            self.preserved = None
        core.drop_kv()
        core.check_integrity()
        return out

    # ---- resume ----------------------------------------------------------------------------
    def resume(self, tags: tuple[str, ...]) -> ControlResult:
        core = self.core
        core.drain()
        todo = [t for t in MEMORY_TAGS if t in tags and t in core.released_tags]
        if not todo:
            return ControlResult(True, f"not released: {list(tags)} (no-op)", {
                "resumed": [], "memory_released": sorted(core.released_tags),
                "already_resident": True})
        details: dict[str, Any] = {"resumed": todo, "host_bytes_freed": 0}
        if "weights" in todo:
            assert self.host_params is not None
            # (on CPU the device arrays may adopt the host copy's buffers: no 2nd copy)
            params = jax.device_put(self.host_params, self.weights.shardings)
            jax.block_until_ready(params)
            core.swap_params(params)
            details["host_bytes_freed"] += _nbytes(self.host_params)
            self.host_params = None
        if "kv_cache" in todo:
            kv = make_kv_pool(core.model_cfg, self.num_pages, core.page_size, self.dtype,
                              sharding=self.kv_sharding, layout=self.kv_layout)
            if self.preserved is not None:
                kv = self._restore(kv, self.preserved)
                details["restored_kv_pages"] = len(self.preserved.pages)
                details["host_bytes_freed"] += self.preserved.nbytes
                self.preserved = None
            core.install_kv(kv)
        # the release's hold ends once everything is resident; other reasons stay
        details["continued"] = not core.released_tags and core.release_hold("memory_released")
        details["memory_released"] = sorted(core.released_tags)
        asleep = "; still asleep" if core.released_tags else ""
        return ControlResult(True, f"resumed {todo}{asleep}", details)

    def readable_leaves(self) -> tuple[Callable[[LeafPath], Any], str]:
        """(leaf by path, where from) for reading weights back: the device params' leaf
        (RLInterface.param: only that leaf is rebuilt where it is held in a compute layout
        only), or the host copy's while the weights are released."""
        if self.host_params is None:
            return self.core.param, "device"
        host = self.host_params
        return (lambda path: get_leaf(host, path)), "host copy (weights released)"

    def _restore(self, kv: KVPool, saved: _PreservedKV) -> KVPool:
        ps = self.core.page_size
        slots = (saved.pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
        slots_dev = jax.device_put(slots, self.replicated)
        k, v = jax.device_put((saved.k, saved.v), self.kv_sharding)
        sh = self.kv_sharding

        layout = kv.layout

        def put(pool_k: jax.Array, pool_v: jax.Array, s: jax.Array, nk: jax.Array,
                nv: jax.Array) -> tuple[jax.Array, jax.Array]:
            return write_slots(pool_k, layout, s, nk), write_slots(pool_v, layout, s, nv)

        fn = jax.jit(put, donate_argnums=(0, 1), out_shardings=(sh, sh))
        new_k, new_v = fn(kv.k, kv.v, slots_dev, k, v)
        return dataclasses.replace(kv, k=new_k, v=new_v)
