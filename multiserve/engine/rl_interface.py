"""RLInterface: the engine as its RL subsystem (engine/rl/) sees it, and all it may use.

The RL managers (WeightManager, MemoryManager) are given this object, not the EngineCore:
its public attributes are the whole interface (`tests/engine/test_rl_boundary.py` checks
engine/rl/ calls nothing else of it and names none of the core's parts). It implements
the device-buffer operations a weight update or memory release needs (the runner's params
and KV pool) and hands the rest (holds, aborts, the weight version) to the core, which
owns them.

Invariants:
- Only the engine thread uses it, between steps: params and the KV pool change only
  while no step is in flight (asserted).
- The page accounting is the scheduler's: `drop_kv` leaves it untouched (requests that
  hold pages are the caller's to retract, or to keep with their K/V saved and restored by
  `install_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multiserve.types import MemoryTag, PauseReason

if TYPE_CHECKING:
    from multiserve.config import ModelConfig
    from multiserve.engine.core import EngineCore
    from multiserve.engine.device.runner import Runner
    from multiserve.model.layers.kv_pool import KVPool


@dataclass(frozen=True)
class HeldPages:
    requests: int  # running requests
    pages: list[int]  # the KV pages they hold, sorted


class RLInterface:
    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.model_cfg: ModelConfig = core.model_cfg
        self.page_size: int = core.page_size
        self.runner: Runner = core.runner  # read for its fixed settings only (mesh, dtype)

    # ---- reads -----------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._core.weight_version

    @property
    def paused(self) -> bool:
        return self._core.pause_state.paused

    @property
    def num_live(self) -> int:
        """Live requests (waiting or running)."""
        return len(self._core.scheduler.reqs)

    @property
    def released_tags(self) -> frozenset[MemoryTag]:
        return self._core.released_tags

    @property
    def params(self) -> Any:
        """The canonical params pytree on the devices (None while released). Read only:
        replace it with `swap_params`. The leaves the runner holds only in a compute
        layout come rebuilt, as new arrays (Runner.params), at each read."""
        return self.runner.params

    def param(self, path: tuple[str, ...]) -> Any:
        """One leaf of the canonical params by path (Runner.param: held, or rebuilt alone);
        None while released."""
        return self.runner.param(path)

    @property
    def param_specs(self) -> Any:
        """Shape, dtype and sharding of every canonical leaf (nothing is read or rebuilt)."""
        return self.runner.param_specs

    @property
    def kv_pool(self) -> KVPool | None:
        """The device KV pool (None while released). Read only."""
        return self.runner.kv

    def running_pages(self) -> HeldPages:
        """The KV pages the running requests hold (what a preserving release saves)."""
        running = self._core.scheduler.running
        return HeldPages(len(running), sorted({p for r in running for p in r.held_pages}))

    # ---- the core's operations -------------------------------------------------------------
    def drain(self) -> None:
        self._core.drain()

    def hold(self, reason: PauseReason, mode: str | None = None) -> dict[str, Any] | None:
        """EngineCore.hold: drain, apply `mode` if the engine ran, add `reason`."""
        return self._core.hold(reason, mode)

    def release_hold(self, reason: PauseReason) -> bool:
        """End hold `reason` (its owner's hold ends): True iff the engine runs again now."""
        return self._core.pause_state.remove_hold(reason)

    def abort_all(self) -> int:
        """Abort every live request; returns how many."""
        return int(self._core.abort(None, abort_all=True).details.get("aborted", 0))

    def abort_started(self) -> int:
        """Abort every live request that was ever admitted (it holds, or held, K/V or
        output computed by the current weights); requests that only wait keep waiting.
        Returns how many were aborted."""
        started = [r for r in self._core.scheduler.reqs.values()
                   if r.admitted_once or r.output_ids]
        for req in started:
            self._core.finish(req, "abort")
        return len(started)

    def set_weight_version(self, version: str) -> dict[str, Any]:
        """EngineCore.set_weight_version: the version outputs carry; old K/V invalidated."""
        return self._core.set_weight_version(version)

    def retract_running(self) -> int:
        """Retract every running request (KV freed, output kept); returns how many."""
        return self._core.retract_running()

    def drop_cached_kv(self) -> int:
        """Free every cached page no request holds; returns how many."""
        return self._core.scheduler.drop_cached_kv()

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (no request may hold a page); returns the pages it had."""
        return self._core.cache.reset()

    def check_integrity(self) -> None:
        """The page accounting (AssertionError if broken)."""
        self._core.scheduler.check_integrity()

    # ---- device buffers (between steps) ----------------------------------------------------
    def swap_params(self, params: Any) -> Any:
        """Put `params` (None: the weights are released) on the runner, which re-derives
        the compute form the step runs on; returns the canonical leaves it held before
        (Runner.held_params: nothing is rebuilt)."""
        assert self._core.in_flight is None, "params change only between steps"
        old = self.runner.held_params
        self.runner.params = params
        self.runner.prime_deferred()
        return old

    def replace_param_leaves(self, leaves: dict[tuple[str, ...], Any]) -> None:
        """A weight update from host values by leaf path (Runner.replace_leaves: how an
        engine spanning hosts updates, every host placing its own shards)."""
        assert self._core.in_flight is None, "params change only between steps"
        self.runner.replace_leaves(leaves)
        self.runner.prime_deferred()

    def drop_kv(self) -> None:
        """Free the device KV pool and the small step buffers (memory release)."""
        assert self._core.in_flight is None, "KV is dropped only between steps"
        kv = self.runner.kv
        assert kv is not None, "the KV pool is released already"
        kv.k.delete()
        kv.v.delete()
        self.runner.kv = None
        self.runner.drop_step_buffers()

    def install_kv(self, kv: KVPool) -> None:
        """Give the runner a KV pool again (memory resume) and fresh step buffers."""
        assert self._core.in_flight is None and self.runner.kv is None
        self.runner.kv = kv
        self.runner.reset_prev_ids()
        self.runner.prime_deferred()
