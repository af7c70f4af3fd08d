"""ControlRunner: drives every control operation of an engine (pause, abort, flush, weight
updates, memory release), and runs the RL commands on the engine thread.

A control operation (multiserve/control_ops.py) becomes an *operation* (`Op`,
`operation(record)`): a one-step record is a command for the engine thread as it is
(PauseGeneration, PublishStagedWeights, ReleaseMemoryOccupation, ...); a staged one
(StageWeightsFromDisk, UpdateWeightsFromTensor, ...), which also works on the caller's side
(read and copy tensors), becomes a generator that yields commands and `OffThread` work and
returns the ControlResult. `run(op)` drives an operation synchronously, `await arun(op)`
asynchronously: `Engine.control` and `Engine.acontrol` are these two over the same
operation. On the engine thread, `execute(cmd)` runs the RL commands with the managers:
engine/rl/weights.py (WeightManager) and engine/rl/memory.py (MemoryManager).

Invariants:
- Everything that touches engine state runs on the engine thread, as a typed command.
  Reading a checkpoint and copying tensors onto the devices (staging) runs on the
  caller's thread (a worker thread for `arun`), so generation is not blocked by disk
  reads; the engine is held meanwhile (pause reason "weights_staged").
- A staging that fails or is interrupted ends its own hold (never another staging's).
- Every RL operation returns a ControlResult. Invalid tensors/checkpoints give ok=False
  with a message naming the tensor; invalid arguments (unknown tag or mode,
  truncate_size < 1) raise ValueError when the record is built, i.e. at the call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiserve.control_ops import (
    AbortWeightUpdate,
    DestroyWeightsUpdateGroup,
    DiscardStagedWeights,
    FinishWeightUpdate,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensors,
    PublishStagedWeights,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    StageWeightsFromDisk,
    StageWeightsFromDistributed,
    StageWeightsFromTensor,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightsFromArrays,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)
from multiserve.engine.commands import (
    AbortSession,
    BeginStaging,
    Command,
    EndStaging,
    RLCommand,
    SessionToken,
)
from multiserve.engine.lora_control import LoraOperations
from multiserve.engine.rl.checks import WeightUpdateError
from multiserve.engine.rl.memory import MemoryManager
from multiserve.engine.rl.session import WeightSession
from multiserve.engine.rl.transfer import TransferGroups
from multiserve.engine.rl.weights import DeviceArrays, WeightManager
from multiserve.model.errors import ModelLoadError
from multiserve.types import ControlResult

if TYPE_CHECKING:
    from multiserve.engine.rl_interface import RLInterface

Submit = Callable[[Command], concurrent.futures.Future]  # Engine.call
Loader = Callable[[], tuple[Any, str, bool]]  # -> (tensors, source, require_all)


@dataclass(frozen=True)
class OffThread:
    """Work of an operation that runs off the engine thread (the caller's thread, or a
    worker thread under `arun`): staging, reading a LoRA adapter."""
    fn: Callable[[], Any]


Op = Command | Generator[Command | OffThread, Any, ControlResult]
Outcome = tuple[Any, BaseException | None]  # a step's (result, None) or (None, exception)


@dataclass(frozen=True)
class Returned:
    """An operation ended with `result`."""
    result: ControlResult


def _resume(op: Generator[Command | OffThread, Any, ControlResult], outcome: Outcome
            ) -> Command | OffThread | Returned:
    """Hand the last step's outcome to the operation (its result, or its exception
    raised inside the operation); the operation's next step, or what it returned."""
    result, error = outcome
    try:
        return op.throw(error) if error is not None else op.send(result)
    except StopIteration as done:
        return Returned(done.value)


def _failed(e: Exception, weight_version: str) -> ControlResult:
    return ControlResult(False, str(e), {"error": str(e), "weight_version": weight_version})


class ControlRunner:
    """See the module docstring. `require_healthy()` raises EngineUnavailable when the
    engine cannot take an update (it runs on the engine thread)."""

    def __init__(self, core: RLInterface, submit: Submit,
                 require_healthy: Callable[[], None],
                 lora: LoraOperations | None = None) -> None:
        self.lora = lora  # the LoRA operations (engine/lora_control.py)
        self.weights = WeightManager(core)
        self.memory = MemoryManager(core, self.weights)
        self.session = WeightSession(self.weights, self.memory)
        # SGLang's weights-update groups, backend "jax" (engine/rl/transfer.py)
        self.transfer = TransferGroups(core.runner.devices)
        self._submit = submit
        self._require_healthy = require_healthy

    # ---- drivers: one operation, sync or async ---------------------------------------------
    def run(self, op: Op) -> ControlResult:
        """Run `op` on this thread (its commands wait for the engine thread)."""
        if not isinstance(op, Generator):
            return self._submit(op).result()
        outcome: Outcome = (None, None)
        while not isinstance(step := _resume(op, outcome), Returned):
            try:
                outcome = (step.fn() if isinstance(step, OffThread)
                           else self._submit(step).result()), None
            except BaseException as e:  # noqa: BLE001 - handed to the operation
                outcome = None, e
        return step.result

    async def arun(self, op: Op) -> ControlResult:
        """`run(op)`, awaited: commands are awaited, OffThread work runs in a worker
        thread (`asyncio.to_thread`)."""
        if not isinstance(op, Generator):
            return await asyncio.wrap_future(self._submit(op))
        outcome: Outcome = (None, None)
        while not isinstance(step := _resume(op, outcome), Returned):
            pending = (asyncio.to_thread(step.fn) if isinstance(step, OffThread)
                       else asyncio.wrap_future(self._submit(step)))
            try:
                outcome = await pending, None
            except BaseException as e:  # noqa: BLE001 - handed to the operation
                outcome = None, e
        return step.result

    # ---- the engine thread: RL commands ----------------------------------------------------
    def execute(self, cmd: RLCommand) -> ControlResult | None:
        """Run one RL command (engine thread, between two steps)."""
        match cmd:
            case BeginStaging(abort_running):
                self._require_healthy()
                return self.weights.begin(abort_running)
            case EndStaging(token):
                self.weights.release_hold_if(token)
                return None
            case PublishStagedWeights(token, abort_running):
                return self.weights.publish(token, abort_running)
            case DiscardStagedWeights(token):
                return self.weights.discard(token)
            case GetWeightsByName(name, truncate_size):
                return self._read(name, truncate_size)
            case ReleaseMemoryOccupation(tags, mode, preserve_state):
                return self.memory.release(tags, mode, preserve_state)
            case ResumeMemoryOccupation(tags):
                return self.memory.resume(tags)
            case StartWeightUpdate(free_kv_cache, abort_running):
                self._require_healthy()
                return self.session.start(free_kv_cache, abort_running)
            case SessionToken():
                return self.session.token()
            case FinishWeightUpdate(weight_version):
                return self.session.finish(weight_version)
            case AbortWeightUpdate():
                return self.session.abort()
            case AbortSession():
                return self.session.abort()
        raise TypeError(f"not an RL command: {cmd!r}")

    def _read(self, name: str, truncate_size: int) -> ControlResult:
        leaf_at, source = self.memory.readable_leaves()
        try:
            out = self.weights.layout.read(leaf_at, name, truncate_size)
        except WeightUpdateError as e:
            return ControlResult(False, str(e), {"name": name})
        return ControlResult(True, f"{name}: shape {out['shape']}", {
            **out, "weight_version": self.weights.core.weight_version, "from": source})

    # ---- the operations ----------------------------------------------------------------------
    def operation(self, record: Any) -> Op:
        """The operation of a control record (control_ops.py): a staged record's generator,
        or a one-step record, which is a command as it is."""
        match record:
            case StageWeightsFromTensor(params, version, abort_running):
                return self._stage(lambda: (params, "<tensors>", False), version, abort_running)
            case StageWeightsFromDisk(path, version, abort_running):
                return self._stage(self._disk_loader(path), version, abort_running)
            case UpdateWeightsFromTensor(params, version, abort_running):
                return self._update(self._stage(lambda: (params, "<tensors>", False), version,
                                                abort_running), abort_running)
            case UpdateWeightsFromArrays(params, version, abort_running):
                return self._update(self._stage(lambda: (DeviceArrays(params), "<arrays>", False),
                                                version, abort_running), abort_running)
            case UpdateWeightsFromDisk(path, version, abort_running):
                return self._update(self._stage(self._disk_loader(path), version,
                                                abort_running), abort_running)
            case UpdateWeights(update_info):
                return self._into_session(update_info)
            case InitWeightsUpdateGroup():
                return self._join(record)
            case UpdateWeightsFromDistributed():  # before its base class
                return self._from_distributed(record, publish=True)
            case StageWeightsFromDistributed():
                return self._from_distributed(record, publish=False)
            case DestroyWeightsUpdateGroup(group_name):
                return self._leave(group_name)
            case LoadLoraAdapter() | LoadLoraAdapterFromTensors() if self.lora is not None:
                return self.lora.load(record, OffThread)
        return record

    def _disk_loader(self, path: str) -> Loader:
        def load() -> tuple[Any, str, bool]:
            named, source = self.weights.layout.read_disk(path)
            return named, source, True
        return load

    def _stage(self, load: Loader, weight_version: str, abort_running: bool
               ) -> Generator[Command | OffThread, Any, ControlResult]:
        begun = yield BeginStaging(abort_running)
        if not begun.ok:
            return begun
        token = begun.details["token"]
        try:
            staged = yield OffThread(lambda: self._stage_body(token, load, weight_version))
        except (WeightUpdateError, ModelLoadError) as e:
            yield EndStaging(token)
            return _failed(e, weight_version)
        except BaseException:
            yield EndStaging(token)
            raise
        return _aborted_first(begun, staged)

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

    def _into_session(self, update_info: dict[str, Any]
                      ) -> Generator[Command | OffThread, Any, ControlResult]:
        """Stage one checkpoint into the open weight-update session (its token); a failed
        staging aborts the session (nothing changes: engine/rl/session.py)."""
        taken = yield SessionToken()
        if not taken.ok:
            return taken
        token = taken.details["token"]
        if "path" in update_info:
            load, source = self._disk_loader(update_info["path"]), update_info["path"]
        else:
            params = update_info["params"]
            load, source = (lambda: (params, "<tensors>", False)), "<tensors>"
        version = _session_version(source)
        try:
            staged = yield OffThread(lambda: self._stage_body(token, load, version))
        except (WeightUpdateError, ModelLoadError) as e:
            yield AbortSession()
            return _failed(e, version)
        except BaseException:
            yield AbortSession()
            raise
        return ControlResult(True, "weights staged in the session: finish_weight_update "
                             "publishes them", staged.details)

    # ---- the JAX weight transfer (SGLang's weights-update group, backend "jax") ----------
    def _join(self, rec: InitWeightsUpdateGroup
              ) -> Generator[Command | OffThread, Any, ControlResult]:
        try:
            joined = yield OffThread(lambda: self.transfer.join(
                rec.group_name, rec.master_address, rec.master_port))
        except WeightUpdateError as e:
            return ControlResult(False, str(e), {"group_name": rec.group_name,
                                                 "error": str(e)})
        return ControlResult(True, f"joined the JAX weight transfer of "
                             f"{joined['trainer_address']} as group {rec.group_name!r} "
                             f"(this engine's transfer server: "
                             f"{joined['transfer_address']}); update_weights_from_"
                             "distributed pulls what the trainer offers", {
                                 **joined, "rank_offset": rec.rank_offset,
                                 "world_size": rec.world_size, "pulls_per_update": 1})

    def _leave(self, group_name: str) -> Generator[Command | OffThread, Any, ControlResult]:
        existed = yield OffThread(lambda: self.transfer.leave(group_name))
        return ControlResult(True, f"weights update group {group_name!r} destroyed"
                             if existed else f"no weights update group {group_name!r} "
                             "(no-op)", {"group_name": group_name, "destroyed": existed})

    def _from_distributed(self, rec: StageWeightsFromDistributed, publish: bool
                          ) -> Generator[Command | OffThread, Any, ControlResult]:
        """Check the body (group, names, shapes, dtypes) before anything is held or
        pulled; then stage (and publish) what the pull brings, as any update."""
        extra = {"group_name": rec.group_name, "transfer_uuid": rec.transfer_uuid}
        try:
            self.transfer.get(rec.group_name)
            self.weights.layout.check_specs(rec.names, rec.dtypes, rec.shapes)
        except WeightUpdateError as e:
            failed = _failed(e, rec.weight_version)
            return ControlResult(False, failed.message, {**failed.details, **extra})
        uuid = rec.transfer_uuid
        assert uuid is not None  # the record derived it from weight_version if not sent
        source = f"jax-transfer:{rec.group_name}#{uuid}"

        def pull() -> tuple[Any, str, bool]:
            arrays = self.transfer.pull(rec.group_name, uuid, rec.names,
                                        rec.dtypes, rec.shapes)
            return arrays, source, False

        stage = self._stage(pull, rec.weight_version, rec.abort_running)
        result = yield from (self._update(stage, rec.abort_running) if publish else stage)
        return ControlResult(result.ok, result.message, {**result.details, **extra})

    @staticmethod
    def _update(stage: Op, abort_running: bool
                ) -> Generator[Command | OffThread, Any, ControlResult]:
        assert isinstance(stage, Generator)
        staged = yield from stage
        if not staged.ok:
            return staged
        published = yield PublishStagedWeights(staged.details["token"], abort_running)
        return _aborted_total(staged, published)


def _aborted_first(begun: ControlResult, staged: ControlResult) -> ControlResult:
    """The staging result, with the requests `begin` aborted (abort_running) counted."""
    n = int(begun.details.get("aborted", 0))
    return ControlResult(staged.ok, staged.message, {**staged.details, "aborted": n})


def _aborted_total(staged: ControlResult, published: ControlResult) -> ControlResult:
    """A whole update's answer: the publish result, counting the requests aborted before
    staging too."""
    n = int(staged.details.get("aborted", 0)) + int(published.details.get("aborted", 0))
    return ControlResult(published.ok, published.message, {**published.details, "aborted": n})


def _session_version(source: str) -> str:
    """The version a session's staging carries until finish names one: the source's name
    and a unique suffix (as an update from disk without weight_version)."""
    name = Path(source.rstrip("/")).name if source.startswith("/") else "tensors"
    return f"{name or 'weights'}-{uuid.uuid4().hex[:8]}"
