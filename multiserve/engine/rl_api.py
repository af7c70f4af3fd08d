"""The Engine's RL-facing public API: memory release/resume and staged weight updates.

Owns `RLEngineMixin`, a base class of `multiserve.Engine`: public sync methods, their
`async_*` twins (for the HTTP side and the supervisor), and the `_cmd_*` handlers that
the engine thread runs between steps. The logic lives in `weights.py` (WeightManager)
and `memory_release.py` (MemoryManager); this file only routes calls to them.

Invariants:
- Everything that touches engine state runs on the engine thread (`Engine._call`).
  Reading a checkpoint and copying tensors onto the devices (staging) runs on the
  caller's thread (or a worker thread for the async twins), so generation is not
  blocked by disk reads; the engine is held paused meanwhile (see weights.py).
- Every public method returns a ControlResult. Invalid tensors/checkpoints give
  ok=False with a message naming the tensor; invalid arguments (unknown tag or mode)
  raise ValueError at the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from multiserve.engine.memory_release import MemoryManager, normalize_tags
from multiserve.engine.weights import WeightManager, WeightUpdateError
from multiserve.model.errors import ModelLoadError
from multiserve.types import PAUSE_MODES, ControlResult, EngineUnavailable

Loader = Callable[[], tuple[Any, str, bool]]  # -> (tensors, source, require_all)


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")


class RLEngineMixin:
    _core: Any
    _healthy: bool
    _reason: str
    _call: Callable[..., Any]
    _acall: Callable[..., Any]

    def _init_rl(self) -> None:
        self._weights = WeightManager(self._core)
        self._memory = MemoryManager(self._core, self._weights)

    # ---- engine-thread commands --------------------------------------------------------
    def _cmd_weights_begin(self, abort_running: bool) -> ControlResult:
        if not self._healthy:
            raise EngineUnavailable(self._reason)
        return self._weights.begin(abort_running)

    def _cmd_weights_publish(self, token: str, abort_running: bool) -> ControlResult:
        return self._weights.publish(token, abort_running)

    def _cmd_weights_discard(self, token: str | None) -> ControlResult:
        return self._weights.discard(token)

    def _cmd_weights_unhold(self, token: str) -> None:
        self._weights.release_hold_if(token)

    def _cmd_weights_read(self, name: str, truncate_size: int) -> ControlResult:
        core = self._core
        resident = "weights" not in core.released_tags
        params = core.runner.params if resident else self._memory.host_params
        try:
            out = self._weights.layout.read(params, name, truncate_size)
        except WeightUpdateError as e:
            return ControlResult(False, str(e), {"name": name})
        return ControlResult(True, f"{name}: shape {out['shape']}", {
            **out, "weight_version": core.weight_version,
            "from": "device" if resident else "host copy (weights released)"})

    def _cmd_release_memory(self, tags: tuple[str, ...], mode: str,
                            preserve_state: bool) -> ControlResult:
        return self._memory.release(tags, mode, preserve_state)

    def _cmd_resume_memory(self, tags: tuple[str, ...]) -> ControlResult:
        return self._memory.resume(tags)

    # ---- staging (caller side) ---------------------------------------------------------
    def _tensor_loader(self, params: Any) -> Loader:
        return lambda: (params, "<tensors>", False)

    def _disk_loader(self, path: str) -> Loader:
        def load() -> tuple[Any, str, bool]:
            named, source = self._weights.layout.read_disk(path)
            return named, source, True
        return load

    def _stage_body(self, token: str, load: Loader, weight_version: str) -> ControlResult:
        tensors, source, require_all = load()
        staged = self._weights.stage(token, tensors, weight_version, require_all=require_all,
                                     source=source)
        nbytes = sum(a.nbytes for a in staged.arrays())
        return ControlResult(True, f"staged weights {weight_version!r} ({staged.names} "
                             f"tensors from {source})", {
                                 "token": token, "weight_version": weight_version,
                                 "tensors": staged.names, "source": source,
                                 "staged_bytes": int(nbytes)})

    @staticmethod
    def _failed(e: Exception, weight_version: str) -> ControlResult:
        return ControlResult(False, str(e), {"error": str(e), "weight_version": weight_version})

    def _stage(self, load: Loader, weight_version: str, abort_running: bool) -> ControlResult:
        begun = self._call("weights_begin", abort_running)
        if not begun.ok:
            return begun
        token = begun.details["token"]
        try:
            return _aborted_first(begun, self._stage_body(token, load, weight_version))
        except (WeightUpdateError, ModelLoadError) as e:
            self._call("weights_unhold", token)
            return self._failed(e, weight_version)
        except BaseException:
            self._call("weights_unhold", token)
            raise

    async def _astage(self, load: Loader, weight_version: str,
                      abort_running: bool) -> ControlResult:
        begun = await self._acall("weights_begin", abort_running)
        if not begun.ok:
            return begun
        token = begun.details["token"]
        try:
            return _aborted_first(begun, await asyncio.to_thread(
                self._stage_body, token, load, weight_version))
        except (WeightUpdateError, ModelLoadError) as e:
            await self._acall("weights_unhold", token)
            return self._failed(e, weight_version)
        except BaseException:
            await self._acall("weights_unhold", token)
            raise

    # ---- weights: sync -------------------------------------------------------------------
    def stage_weights_from_tensor(self, params: Any, weight_version: str,
                                  abort_running: bool = False) -> ControlResult:
        """Validate + copy `params` (flat {HF name: array}, (name, array) pairs, or the
        params pytree; a subset updates only those tensors) onto the engine's devices.
        details["token"] publishes it. Refused if requests run and the engine is not
        paused (unless abort_running). The engine is held paused until publish/discard."""
        return self._stage(self._tensor_loader(params), weight_version, abort_running)

    def stage_weights_from_disk(self, path: str, weight_version: str,
                                abort_running: bool = False) -> ControlResult:
        """Like stage_weights_from_tensor, from an HF safetensors dir (every tensor)."""
        return self._stage(self._disk_loader(path), weight_version, abort_running)

    def publish_staged_weights(self, token: str, abort_running: bool = False) -> ControlResult:
        """Swap the staged weights in (between two steps), set the version, invalidate
        the prefix cache; abort_running aborts every live request first."""
        return self._call("weights_publish", token, abort_running)

    def discard_staged_weights(self, token: str | None = None) -> ControlResult:
        return self._call("weights_discard", token)

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
        """details: name, shape (HF orientation), dtype, values = the first
        `truncate_size` rows as nested lists, weight_version."""
        if truncate_size < 1:
            raise ValueError("truncate_size: must be >= 1")
        return self._call("weights_read", name, truncate_size)

    # ---- weights: async ------------------------------------------------------------------
    async def async_stage_weights_from_tensor(self, params: Any, weight_version: str,
                                              abort_running: bool = False) -> ControlResult:
        return await self._astage(self._tensor_loader(params), weight_version, abort_running)

    async def async_stage_weights_from_disk(self, path: str, weight_version: str,
                                            abort_running: bool = False) -> ControlResult:
        return await self._astage(self._disk_loader(path), weight_version, abort_running)

    async def async_publish_staged_weights(self, token: str,
                                           abort_running: bool = False) -> ControlResult:
        return await self._acall("weights_publish", token, abort_running)

    async def async_discard_staged_weights(self, token: str | None = None) -> ControlResult:
        return await self._acall("weights_discard", token)

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
        return await self._acall("weights_read", name, truncate_size)

    # ---- memory --------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Any = ("weights", "kv_cache"),
                                  mode: str = "retract",
                                  preserve_state: bool = False) -> ControlResult:
        """Pause (if running, with `mode`), then free the tagged device buffers; new
        requests wait until resume. preserve_state keeps in-place paused requests' K/V
        on the host and restores it exactly."""
        _check_mode(mode)
        return self._call("release_memory", normalize_tags(tags), mode, bool(preserve_state))

    def resume_memory_occupation(self, tags: Any = ("weights", "kv_cache")) -> ControlResult:
        return self._call("resume_memory", normalize_tags(tags))

    async def async_release_memory_occupation(self, tags: Any = ("weights", "kv_cache"),
                                              mode: str = "retract",
                                              preserve_state: bool = False) -> ControlResult:
        _check_mode(mode)
        return await self._acall("release_memory", normalize_tags(tags), mode,
                                 bool(preserve_state))

    async def async_resume_memory_occupation(self, tags: Any = ("weights", "kv_cache")
                                             ) -> ControlResult:
        return await self._acall("resume_memory", normalize_tags(tags))


def _aborted_first(begun: ControlResult, staged: ControlResult) -> ControlResult:
    """The staging result, with the requests `begin` aborted (abort_running) counted."""
    n = int(begun.details.get("aborted", 0))
    return ControlResult(staged.ok, staged.message, {**staged.details, "aborted": n})


def _aborted_total(staged: ControlResult, published: ControlResult) -> ControlResult:
    """A whole update's answer: the publish result, counting the requests aborted before
    staging too."""
    n = int(staged.details.get("aborted", 0)) + int(published.details.get("aborted", 0))
    return ControlResult(published.ok, published.message, {**published.details, "aborted": n})
