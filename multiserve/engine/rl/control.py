"""RLControl: weight updates and memory release of one engine, behind one object.

The Engine composes one RLControl and forwards its public RL methods here (same names and
signatures); the logic lives in `weights.py` (WeightManager) and `memory.py`
(MemoryManager). RLControl reaches the engine only through what it is given: the core
(whose narrow methods the managers use) and a way to run a function on the engine thread
between two steps, sync or async.

Invariants:
- Everything that touches engine state runs on the engine thread (`run` / `arun`).
  Reading a checkpoint and copying tensors onto the devices (staging) runs on the
  caller's thread (or a worker thread for the async twins), so generation is not
  blocked by disk reads; the engine is held meanwhile (pause reason "weights_staged").
- A staging that fails or is interrupted ends its own hold (never another staging's).
- Every public method returns a ControlResult. Invalid tensors/checkpoints give
  ok=False with a message naming the tensor; invalid arguments (unknown tag or mode)
  raise ValueError at the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from multiserve.engine.rl.checks import WeightUpdateError
from multiserve.engine.rl.memory import MemoryManager, normalize_tags
from multiserve.engine.rl.weights import WeightManager
from multiserve.model.errors import ModelLoadError
from multiserve.types import MEMORY_TAGS, ControlResult, check_pause_mode

if TYPE_CHECKING:
    from multiserve.engine.core import EngineCore

OnEngineThread = Callable[[Callable[["EngineCore"], Any]], Any]  # runs fn(core), returns
AOnEngineThread = Callable[[Callable[["EngineCore"], Any]], Awaitable[Any]]
Loader = Callable[[], tuple[Any, str, bool]]  # -> (tensors, source, require_all)


def _failed(e: Exception, weight_version: str) -> ControlResult:
    return ControlResult(False, str(e), {"error": str(e), "weight_version": weight_version})


class RLControl:
    """See the module docstring. `require_healthy()` raises EngineUnavailable when the
    engine cannot take an update (it runs on the engine thread)."""

    def __init__(self, core: EngineCore, run: OnEngineThread, arun: AOnEngineThread,
                 require_healthy: Callable[[], None]) -> None:
        self.weights = WeightManager(core)
        self.memory = MemoryManager(core, self.weights)
        self._run = run
        self._arun = arun
        self._require_healthy = require_healthy

    # ---- engine-thread bodies ------------------------------------------------------------
    def _begin(self, abort_running: bool) -> ControlResult:
        self._require_healthy()
        return self.weights.begin(abort_running)

    def _read(self, name: str, truncate_size: int) -> ControlResult:
        params, source = self.memory.readable_params()
        try:
            out = self.weights.layout.read(params, name, truncate_size)
        except WeightUpdateError as e:
            return ControlResult(False, str(e), {"name": name})
        return ControlResult(True, f"{name}: shape {out['shape']}", {
            **out, "weight_version": self.weights.core.weight_version, "from": source})

    # ---- staging (caller side) -----------------------------------------------------------
    def _tensor_loader(self, params: Any) -> Loader:
        return lambda: (params, "<tensors>", False)

    def _disk_loader(self, path: str) -> Loader:
        def load() -> tuple[Any, str, bool]:
            named, source = self.weights.layout.read_disk(path)
            return named, source, True
        return load

    def _stage_body(self, token: str, load: Loader, weight_version: str) -> ControlResult:
        tensors, source, require_all = load()
        staged = self.weights.stage(token, tensors, weight_version, require_all=require_all,
                                    source=source)
        nbytes = sum(a.nbytes for a in staged.arrays())
        return ControlResult(True, f"staged weights {weight_version!r} ({staged.names} "
                             f"tensors from {source})", {
                                 "token": token, "weight_version": weight_version,
                                 "tensors": staged.names, "source": source,
                                 "staged_bytes": int(nbytes)})

    def _unhold(self, token: str) -> Callable[[EngineCore], None]:
        return lambda core: self.weights.release_hold_if(token)

    def _stage(self, load: Loader, weight_version: str, abort_running: bool) -> ControlResult:
        begun = self._run(lambda core: self._begin(abort_running))
        if not begun.ok:
            return begun
        token = begun.details["token"]
        try:
            return _aborted_first(begun, self._stage_body(token, load, weight_version))
        except (WeightUpdateError, ModelLoadError) as e:
            self._run(self._unhold(token))
            return _failed(e, weight_version)
        except BaseException:
            self._run(self._unhold(token))
            raise

    async def _astage(self, load: Loader, weight_version: str,
                      abort_running: bool) -> ControlResult:
        begun = await self._arun(lambda core: self._begin(abort_running))
        if not begun.ok:
            return begun
        token = begun.details["token"]
        try:
            return _aborted_first(begun, await asyncio.to_thread(
                self._stage_body, token, load, weight_version))
        except (WeightUpdateError, ModelLoadError) as e:
            await self._arun(self._unhold(token))
            return _failed(e, weight_version)
        except BaseException:
            await self._arun(self._unhold(token))
            raise

    # ---- weights: sync ---------------------------------------------------------------------
    def stage_weights_from_tensor(self, params: Any, weight_version: str,
                                  abort_running: bool = False) -> ControlResult:
        return self._stage(self._tensor_loader(params), weight_version, abort_running)

    def stage_weights_from_disk(self, path: str, weight_version: str,
                                abort_running: bool = False) -> ControlResult:
        return self._stage(self._disk_loader(path), weight_version, abort_running)

    def publish_staged_weights(self, token: str, abort_running: bool = False) -> ControlResult:
        return self._run(lambda core: self.weights.publish(token, abort_running))

    def discard_staged_weights(self, token: str | None = None) -> ControlResult:
        return self._run(lambda core: self.weights.discard(token))

    def update_weights_from_tensor(self, params: Any, weight_version: str,
                                   abort_running: bool = False) -> ControlResult:
        staged = self.stage_weights_from_tensor(params, weight_version, abort_running)
        if not staged.ok:
            return staged
        return _aborted_total(staged, self.publish_staged_weights(
            staged.details["token"], abort_running))

    def update_weights_from_disk(self, path: str, weight_version: str,
                                 abort_running: bool = False) -> ControlResult:
        staged = self.stage_weights_from_disk(path, weight_version, abort_running)
        if not staged.ok:
            return staged
        return _aborted_total(staged, self.publish_staged_weights(
            staged.details["token"], abort_running))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> ControlResult:
        if truncate_size < 1:
            raise ValueError("truncate_size: must be >= 1")
        return self._run(lambda core: self._read(name, truncate_size))

    # ---- weights: async --------------------------------------------------------------------
    async def async_stage_weights_from_tensor(self, params: Any, weight_version: str,
                                              abort_running: bool = False) -> ControlResult:
        return await self._astage(self._tensor_loader(params), weight_version, abort_running)

    async def async_stage_weights_from_disk(self, path: str, weight_version: str,
                                            abort_running: bool = False) -> ControlResult:
        return await self._astage(self._disk_loader(path), weight_version, abort_running)

    async def async_publish_staged_weights(self, token: str,
                                           abort_running: bool = False) -> ControlResult:
        return await self._arun(lambda core: self.weights.publish(token, abort_running))

    async def async_discard_staged_weights(self, token: str | None = None) -> ControlResult:
        return await self._arun(lambda core: self.weights.discard(token))

    async def async_update_weights_from_tensor(self, params: Any, weight_version: str,
                                               abort_running: bool = False) -> ControlResult:
        staged = await self.async_stage_weights_from_tensor(params, weight_version,
                                                            abort_running)
        if not staged.ok:
            return staged
        return _aborted_total(staged, await self.async_publish_staged_weights(
            staged.details["token"], abort_running))

    async def async_update_weights_from_disk(self, path: str, weight_version: str,
                                             abort_running: bool = False) -> ControlResult:
        staged = await self.async_stage_weights_from_disk(path, weight_version, abort_running)
        if not staged.ok:
            return staged
        return _aborted_total(staged, await self.async_publish_staged_weights(
            staged.details["token"], abort_running))

    async def async_get_weights_by_name(self, name: str,
                                        truncate_size: int = 100) -> ControlResult:
        if truncate_size < 1:
            raise ValueError("truncate_size: must be >= 1")
        return await self._arun(lambda core: self._read(name, truncate_size))

    # ---- memory ----------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Any = MEMORY_TAGS, mode: str = "retract",
                                  preserve_state: bool = False) -> ControlResult:
        check_pause_mode(mode)
        tags = normalize_tags(tags)
        return self._run(lambda core: self.memory.release(tags, mode, bool(preserve_state)))

    def resume_memory_occupation(self, tags: Any = MEMORY_TAGS) -> ControlResult:
        tags = normalize_tags(tags)
        return self._run(lambda core: self.memory.resume(tags))

    async def async_release_memory_occupation(self, tags: Any = MEMORY_TAGS,
                                              mode: str = "retract",
                                              preserve_state: bool = False) -> ControlResult:
        check_pause_mode(mode)
        tags = normalize_tags(tags)
        return await self._arun(lambda core: self.memory.release(tags, mode,
                                                                 bool(preserve_state)))

    async def async_resume_memory_occupation(self, tags: Any = MEMORY_TAGS) -> ControlResult:
        tags = normalize_tags(tags)
        return await self._arun(lambda core: self.memory.resume(tags))


def _aborted_first(begun: ControlResult, staged: ControlResult) -> ControlResult:
    """The staging result, with the requests `begin` aborted (abort_running) counted."""
    n = int(begun.details.get("aborted", 0))
    return ControlResult(staged.ok, staged.message, {**staged.details, "aborted": n})


def _aborted_total(staged: ControlResult, published: ControlResult) -> ControlResult:
    """A whole update's answer: the publish result, counting the requests aborted before
    staging too."""
    n = int(staged.details.get("aborted", 0)) + int(published.details.get("aborted", 0))
    return ControlResult(published.ok, published.message, {**published.details, "aborted": n})
