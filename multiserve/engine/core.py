"""EngineCore: the thread-confined heart of one engine: admission, stepping, finishing,
pausing, flushing.

Only the engine's own thread calls into an EngineCore (docs/architecture.md §3); the public
`Engine` hands work to it through a queue of typed commands. Owns: the scheduler (which
owns the Reqs), the runner, the step in flight, step counters, the pause state, the
weight version. A step passes three rooms, one value each (`_overlap`): `Scheduler.schedule
-> ScheduledBatch`, `StepInputs.build -> DeviceStep` (engine/step_inputs/), `Device.run ->
InFlight` (engine/device/device.py); the per-phase timer wraps those calls
(`HostPhases.timed`). Its other jobs live beside it, each in its own module:
- what a step computes, its logits rows included: `Scheduler.schedule` (a complete
  ScheduledBatch, engine/sched/batch.py, with its RowPlan, engine/sched/row_plan.py);
- everything the device needs for it (token arrays, page table, sampler rows and their
  reuse across plain decode steps): engine/step_inputs/device_step.py (`StepInputs`);
- a step's logprobs on the host: engine/sampling/logprobs.py (`StepLogprobs`);
- when a sample ends: engine/sched/stop_rules.py (`StopRules`);
- recording a step's results on the Reqs: `Scheduler.postprocess`;
- routing replay's expert ids by KV slot: engine/base/routed_experts.py (`RoutedExpertsTable`,
  recorded here as each step is read back, before `postprocess`);
- why the engine is paused: engine/base/pause_state.py (`PauseState`);
- what the RL subsystem may do to it: engine/rl_interface.py (`RLInterface`);
- what get_internal_state reports: engine/state_report.py.

Invariants:
- At most one step is in flight (`self.in_flight`, an `InFlight`: the batch as
  scheduled, never written after, plus what its launch learned: the token bucket, the
  launch time, the runner's output); under overlap, step N+1 is launched before step N's
  results are read. `drain()` reads the step in flight, after which no
  device work of this engine is pending: every control operation that needs
  quiescence (pause, flush, weight updates, memory release) drains first.
- Every Req reaches exactly one final output (finished=True) through its sink, every
  output through `_deliver`. Every end is recorded by `Scheduler.finish`: stop/length
  endings inside `Scheduler.postprocess` (delivered with the step's outputs), the rest
  (abort, a fault, shutdown) through `finish` here; a sink that raises ends its request
  without a further delivery. Request state itself changes only in the Scheduler.
- The engine is paused iff its PauseState has a reason; while it has, `step()` is never
  called (the loop sleeps on its queue). "user" is set and cleared only by `pause()` /
  `resume()` (a "wait" pause sets it in `settle_wait_pause`, once the requests live when
  it began have finished; until then admission is closed and nothing else changes);
  every other reason only by the subsystem that holds the engine (`hold()`, ended by
  `RLInterface.release_hold`: weight staging, memory release). A user pause takes effect
  (its mode applies) whether or not a hold is active, and no hold's end clears it.
- Device state outside a step (params, the KV pool, the weight version) changes only
  between steps, through `set_weight_version` and RLInterface's `swap_params`,
  `drop_kv`, `install_kv` (asserted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from multiserve.config import EngineConfig, ModelConfig
from multiserve.engine.base.lora_adapters import LoraAdapter, LoraRefused, LoraTable
from multiserve.engine.base.pause_state import PauseState
from multiserve.engine.base.routed_experts import RoutedExpertsTable
from multiserve.engine.device.device import Device, InFlight
from multiserve.engine.device.runner import Runner
from multiserve.engine.host_phases import NO_PHASES, HostPhases, NoPhases
from multiserve.engine.sampling.logprobs import StepLogprobs
from multiserve.engine.sched.admission import AdmissionLimits, check_admission
from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.page_allocator import PageAllocator
from multiserve.engine.sched.prefix_cache import PrefixCache
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.scheduler import Scheduler
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.spec.drafter import Drafter
from multiserve.engine.step_inputs.device_step import StepInputs
from multiserve.engine.wait_pause import Pending, WaitPause
from multiserve.types import (
    ControlResult,
    FinishReason,
    InvalidRequest,
    MemoryTag,
    PauseReason,
)

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, runner: Runner,
                 num_pages: int, max_context: int, eos_ids: Sequence[int],
                 stop_string_checker: Any = None) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.runner = runner
        self.page_size = cfg.page_size
        self.max_context = max_context
        self.max_pages = -(-max_context // cfg.page_size)
        self.eos_ids = frozenset(eos_ids)
        self.stop_rules = StopRules(self.eos_ids, max_context, stop_string_checker)
        self.allocator = PageAllocator(num_pages, cfg.page_size)
        self.cache = PrefixCache(self.allocator, cfg.page_size,
                                 enabled=not cfg.disable_prefix_cache)
        # routing replay: the expert ids by KV slot, recorded as each step is read back
        self.routed_experts = (RoutedExpertsTable(model_cfg, num_pages * cfg.page_size,
                                                  cfg.page_size)
                               if runner.routed_experts else None)
        # the step's rooms after the scheduler: its inputs, then the device that runs them
        self.inputs = StepInputs(runner, self.stop_rules, model_cfg.vocab_size, self.max_pages,
                                 cfg.page_size)
        self.device = Device(runner)
        self.scheduler = Scheduler(cfg, self.allocator, self.cache, max_context,
                                   max(cfg.precompile_token_paddings),
                                   max(cfg.precompile_bs_paddings),
                                   drafter=Drafter() if cfg.speculative_algorithm else None,
                                   routed_experts=self.routed_experts,
                                   kv_window=model_cfg.kv_window)
        self.in_flight: InFlight | None = None
        self.last_batch: ScheduledBatch | None = None
        self.pause_state = PauseState()
        self.wait_pause: WaitPause | None = None  # a "wait" pause still draining
        self.weight_version = cfg.weight_version
        self.loras = LoraTable(cfg.max_loras_per_batch)  # adapter name -> slot
        # the slots of adapter versions replaced (load_inplace) while live requests used
        # them: no name maps to them; each is taken again once no live request uses it
        self.retired_lora_slots: set[int] = set()
        self.forward_ct = 0
        self.forward_ct_decode = 0
        # the engine loop's passes (one per wake-up), and those that ran neither a command
        # nor a step (0 while the loop blocks whenever idle or paused: no busy-wait)
        self.loop_passes = 0
        self.empty_passes = 0
        self._last_read_at = 0.0  # when the last step's results were read (perf_counter)
        self._drained_at: float | None = None  # this step() read the step in flight first
        self.overlap = not cfg.disable_overlap
        self.scheduler.planner.step_costs.overlap = self.overlap
        self.initial_available = self.scheduler.available_kv_tokens()
        self.admission = AdmissionLimits.from_config(cfg, self.initial_available)
        self._fault: str | None = None  # the next step raises this (inject_fault)
        # a measuring aid (engine/host_phases.py; `host_phases`): the step's timer,
        # NO_PHASES (every call a no-op) while none is set
        self._phases: HostPhases | NoPhases = NO_PHASES

    @property
    def host_phases(self) -> HostPhases | None:
        """The per-phase host timer of the step passes (engine/host_phases.py), or None:
        off (the default)."""
        return self._phases if isinstance(self._phases, HostPhases) else None

    @host_phases.setter
    def host_phases(self, phases: HostPhases | None) -> None:
        self._phases = phases if phases is not None else NO_PHASES

    # ---- requests ------------------------------------------------------------------
    def add(self, reqs: Sequence[Req]) -> None:
        """Admit a batch atomically: all of it, or (a rid live already or repeated in the
        batch) none of it."""
        keys: set[tuple[str, int]] = set()
        slots: list[int] = []
        for req in reqs:
            if req.key in self.scheduler.reqs or req.key in keys:
                raise InvalidRequest(f"rid: a live request already uses rid {req.rid!r}",
                                     param="rid")
            keys.add(req.key)
            slots.append(self._lora_slot(req.lora_name, req.lora_optional))
        check_admission(self.scheduler.waiting, reqs, self.admission)  # or EngineOverloaded
        for req, slot in zip(reqs, slots, strict=True):
            self.scheduler.add(req, lora_slot=slot)
            if req.grammar is not None and req.grammar.failed:
                self.finish(req, "abort", "the grammar rejected tokens of the resumed output "
                            f"(grammar_resumed={req.params.grammar_resumed}): "
                            f"{req.grammar.error}")
            elif req.params.max_new_tokens == 0 and not req.needs_prompt_logprobs:
                self.finish(req, "length")
            # else max_new_tokens == 0 with prompt logprobs: prefill only (scoring)

    def _lora_slot(self, name: str | None, optional: bool) -> int:
        """The slot of a request's adapter (0: none; no such adapter loaded: 0 when
        `optional`, else InvalidRequest code "lora_not_found" naming it)."""
        if name is None:
            return 0
        try:
            return self.loras.slot_of(name)
        except LoraRefused as exc:
            if optional:
                return 0
            raise InvalidRequest(str(exc), "lora_name", "lora_not_found") from exc

    # ---- LoRA adapters (engine/base/lora_adapters.py): between steps, engine thread --------
    def load_lora(self, adapter: LoraAdapter, replace: bool = False) -> dict[str, Any]:
        """Put a checked adapter into a free slot (LoraRefused: the name is loaded, or
        every slot is taken; nothing changes). Steps launched from now on may use it.
        `replace` (sglang's load_inplace) with the name loaded: the new version takes the
        name. Live requests (running or queued) keep the slot they were admitted with, so
        they finish on the version they started with; requests admitted from now on get
        the new one. It is written into the old version's slot when no live request uses
        that, else into a free slot ("full" when none), the old slot retired until its
        last request is done. Without the name loaded, `replace` is a plain load."""
        self.retired_lora_slots = {s for s in self.retired_lora_slots if self._lora_users(s)}
        busy = frozenset(self.retired_lora_slots)
        old = self.loras.slot_of(adapter.name) if (
            replace and adapter.name in self.loras.adapters) else None
        if old is not None and not self._lora_users(old):
            slot = old
        else:
            slot = self.loras.free_slot(adapter.name, busy, replacing=old is not None)
        self.runner.write_lora(slot, adapter)
        self.scheduler.lora_slot_written(slot)
        if old is not None:
            self.loras.remove(adapter.name)
            if slot != old:
                self.retired_lora_slots.add(old)
        self.loras.add(adapter, slot)
        return {"name": adapter.name, "slot": slot, "rank": adapter.rank,
                "replaced": old is not None}

    def _lora_users(self, slot: int) -> int:
        """The live requests (running or queued) admitted with LoRA slot `slot`."""
        return sum(1 for r in self.scheduler.reqs.values() if r.lora_slot == slot)

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Free adapter `name`'s slot (LoraRefused "unknown", or "in_use" while live
        requests use it: their count is in the message)."""
        slot = self.loras.slot_of(name)
        users = self._lora_users(slot)
        if users:
            raise LoraRefused("in_use", f"LoRA adapter {name!r} is in use by {users} live "
                              "request(s); unload it once they finish (or abort them)")
        self.loras.remove(name)
        self.runner.write_lora(slot, None)
        self.scheduler.lora_slot_written(slot)
        return {"name": name, "slot": slot}

    def has_work(self) -> bool:
        return self.in_flight is not None or (not self.pause_state.paused
                                              and self.scheduler.has_work())

    # ---- stepping ------------------------------------------------------------------
    def step(self) -> None:
        """One pass of the overlap loop: the step in flight goes in, the step launched now
        comes out (`_overlap`)."""
        assert not self.pause_state.paused, self.pause_state.reasons
        if self._fault is not None:
            msg, self._fault = self._fault, None
            raise RuntimeError(msg)
        phases = self._phases
        phases.start()
        if self.in_flight is not None and (self.in_flight.batch.speculative
                                           or self.in_flight.batch.constrained
                                           or self.scheduler.wants_drafts()):
            # a draft needs every token of its request known, a verify row's accepted
            # length decides the next positions, and a grammar's next mask needs the token
            # just sampled: read the step in flight first
            self.drain()
            self._drained_at = time.perf_counter()
        # while `_overlap` reads it, `in_flight` still names the step before: a step that
        # raises leaves it there (the engine loop's failure path, engine.py)
        self.in_flight = self._overlap(self.in_flight)
        if not self.overlap:
            self.drain()
        if self.in_flight is None and not self.scheduler.running:
            self.scheduler.check_integrity()
        phases.lap("advance")
        phases.end()

    def _overlap(self, prev: InFlight | None) -> InFlight | None:
        """Schedule and launch the next step (if any), then read `prev`: the three rooms
        (scheduler -> StepInputs -> Device) and the step now in flight."""
        if self.cfg.decode_steps_per_dispatch > 1:  # the sizes K decode steps may run at
            self.scheduler.compiled = self.runner.compiled_sizes()
        timed = self._phases.timed
        batch = timed("schedule", self.scheduler.schedule)
        launched = None
        if batch is not None:
            self._phases.saw(batch.num_tokens == len(batch.rows), len(batch.rows),
                             batch.decode_steps)
            launched = timed("launch", self.device.run, timed("inputs", self.inputs.build,
                                                                batch))
            timed("advance", self._launched, launched)
        self._drained_at = None
        if prev is not None:
            self._process(prev)
        return launched

    def drain(self) -> None:
        if self.in_flight is not None:
            inflight, self.in_flight = self.in_flight, None
            self._process(inflight)

    def _launched(self, step: InFlight) -> None:
        """The bookkeeping of a step just launched: the scheduler advances its requests."""
        batch = step.batch
        if self._drained_at is not None:
            # the step before was read first: the host's work since delayed this launch
            self.scheduler.planner.step_costs.observe_host(step.launched_at - self._drained_at)
        decodes = any(not r.req.in_prefill and r.samples and (r.end - r.start == 1 or r.draft)
                      for r in batch.rows)
        self.scheduler.launch(batch)
        self.forward_ct += 1
        if decodes:
            self.forward_ct_decode += 1

    def _process(self, step: InFlight) -> None:
        """Read `step`'s results (blocks on the device), let the scheduler record them,
        and deliver what they completed."""
        phases = self._phases
        phases.saw(step.batch.num_tokens == len(step.batch.rows))
        phases.lap("advance")  # what ran since the last lap
        next_ids = phases.timed("read_back", np.asarray, step.out.next_ids)
        # the step's cost: from when the device could start it (its launch, or the read
        # of the step before it) to its results read
        now = time.perf_counter()
        # (a dispatch of K decode steps: the cost of one of them)
        self.scheduler.planner.step_costs.observe(
            step.padded_tokens,
            (now - max(step.launched_at, self._last_read_at)) / step.out.decode_steps)
        self._last_read_at = now
        deliver = phases.timed("postprocess", self._record, step, next_ids)
        phases.timed("deliver", self._deliver_all, deliver)

    def _record(self, step: InFlight, next_ids: np.ndarray) -> Sequence[Req]:
        """Record `step`'s results read back (`next_ids`): its logprobs, routed experts
        and the scheduler's postprocess; returns the Reqs with output to deliver."""
        batch, out = step.batch, step.out
        lp = StepLogprobs(out.sample) if out.wants_logprobs else None
        if out.decode_steps > 1:
            self.last_batch = batch
            return self.scheduler.postprocess_decode_steps(
                batch, next_ids.tolist(),
                [lp.step(k) for k in range(out.decode_steps)] if lp is not None else None,
                self.weight_version, self.stop_rules)
        if self.routed_experts is not None and step.out_slots is not None:
            # before postprocess: a sample it finishes copies its rows out (Req.keep_routing)
            self.routed_experts.record(step.out_slots, np.asarray(out.routed_experts))
        self.last_batch = batch
        return self.scheduler.postprocess(batch, next_ids.tolist(), lp, self.weight_version,
                                          self.stop_rules)

    def _deliver_all(self, deliver: Sequence[Req]) -> None:
        """After a step's postprocess: deliver each of `deliver`."""
        for req in deliver:
            self._deliver(req)

    def finish(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """THE finish path: the scheduler records it (finished, `reason`, no longer live,
        KV released), then the Req's final output is delivered (with `error`, if any).
        Delivered even if the scheduler's queues are broken (after a fault): then the
        scheduler's exception follows the delivery."""
        try:
            self.scheduler.finish(req, reason)
        finally:
            self._deliver(req, error)

    def fail_all(self, error: str) -> None:
        """A step raised (or the engine stops): the step in flight is dropped and every
        live request ends with "abort" and `error`, whatever state a fault left behind."""
        self.in_flight = None
        for req in list(self.scheduler.reqs.values()):
            try:
                self.finish(req, "abort", error)
            except Exception:  # noqa: BLE001 - state may be broken after a fault
                pass

    def inject_fault(self, message: str) -> None:
        """Test and chaos hook (command InjectFault): the next step raises
        RuntimeError(message)."""
        self._fault = message

    def set_overlap(self, on: bool) -> None:
        """Benchmarks: from now on launch step N+1 before reading step N (on), or not."""
        self.drain()
        self.overlap = on
        self.scheduler.planner.step_costs.overlap = on

    def set_speculation(self, on: bool) -> None:
        """Benchmarks: drain, then draft from a fresh n-gram drafter (on: no memory of
        earlier requests) or not at all (off)."""
        self.drain()
        self.scheduler.planner.set_source(Drafter() if on else None)

    def _deliver(self, req: Req, error: str | None = None) -> None:
        """Hand the Req's new output (a delta: the tokens since the last delivery, and how
        it finished) to its sink: the one place a sink is called. A sink that raises is
        its consumer's fault, not the engine's: that request alone is aborted (finished
        without a further delivery), the engine goes on."""
        try:
            req.sink(req.next_delta(self.weight_version, error))
        except Exception:  # noqa: BLE001 - isolate one consumer's failure
            log.exception("output sink of request %s raised; the request is aborted", req.rid)
            if not req.finished:
                self.scheduler.finish(req, "abort")

    # ---- control -------------------------------------------------------------------
    def abort(self, rid: str | None, abort_all: bool) -> ControlResult:
        if abort_all:
            targets = list(self.scheduler.reqs.values())
        else:
            targets = [r for r in self.scheduler.reqs.values() if r.rid == rid]
        if not targets:
            if abort_all:
                return ControlResult(True, "no live requests to abort", {"aborted": 0})
            return ControlResult(True, f"no live request with rid {rid!r}",
                                 {"aborted": 0, "unknown_rid": rid})
        for req in targets:
            self.finish(req, "abort")
        return ControlResult(True, f"aborted {len(targets)} request(s)",
                             {"aborted": len(targets),
                              "rids": sorted({r.rid for r in targets})})

    # ---- pause state (engine/base/pause_state.py) ----------------------------------------
    def hold(self, reason: PauseReason, mode: str | None = None) -> dict[str, Any] | None:
        """A subsystem holds the engine still: drain, then add `reason`. With `mode`, and
        only if the engine was running (no reason set), first apply that pause mode to the
        requests (what a memory release does); returns its details, else None."""
        self.drain()
        running = not self.pause_state.paused
        applied = self._apply_mode(mode) if mode is not None and running else None
        self.pause_state.add_hold(reason)
        return applied

    def _apply_mode(self, mode: str) -> dict[str, Any]:
        """What a pause does to the requests (the caller drained): abort ends them all,
        retract moves the running ones (KV freed) to the front of waiting, in_place
        moves nothing."""
        details: dict[str, Any] = {"mode": mode}
        if mode == "abort":
            details["aborted"] = self.abort(None, abort_all=True).details.get("aborted", 0)
        elif mode == "retract":
            before = self.scheduler.available_kv_tokens()
            details["retracted"] = self.retract_running()
            details["freed_kv_tokens"] = self.scheduler.available_kv_tokens() - before
        return details

    def retract_running(self) -> int:
        """Retract every running request (KV freed, output kept, to the front of
        waiting); returns how many."""
        running = list(self.scheduler.running)
        self.scheduler.retract(running)
        return len(running)

    def pause(self, mode: str, clear_cache: bool = False) -> ControlResult | Pending:
        """The user's pause: takes effect even while a hold is active (its mode applies).
        "wait" answers later (a Pending): admission closes now, and the pause is set once
        the requests live now have finished (`settle_wait_pause`). `clear_cache`: after
        abort, retract or wait, the cached K/V no request holds is dropped."""
        if self.pause_state.user:
            return ControlResult(True, "already paused (no-op)",
                                 {"already_paused": True, "mode": mode,
                                  "pause_reasons": self.pause_state.reasons})
        if mode == "wait":
            if self.wait_pause is None:
                self.wait_pause = WaitPause(self.scheduler.close_admission(), clear_cache)
                return self.wait_pause.answer
            return self.wait_pause.join(clear_cache)
        self.drain()
        details = self._apply_mode(mode)
        if clear_cache and mode != "in_place":
            details["cleared_cached_pages"] = self.scheduler.drop_cached_kv()
        self.pause_state.set_user()
        details["pause_reasons"] = self.pause_state.reasons
        self._end_wait_pause(ControlResult(True, f"paused: a {mode} pause came first",
                                           {"mode": mode, "superseded_by": mode}))
        return ControlResult(True, f"paused ({mode})", details)

    def settle_wait_pause(self) -> None:
        """Between steps: a "wait" pause whose requests have all finished takes effect
        now (the user's pause is set, admission reopens behind it) and answers."""
        wait = self.wait_pause
        if wait is None or not wait.drained:
            return
        self.drain()
        self.wait_pause = None
        self.scheduler.open_admission()
        details: dict[str, Any] = {"mode": "wait", "finished": len(wait.live)}
        if wait.clear_cache:
            details["cleared_cached_pages"] = self.scheduler.drop_cached_kv()
        self.pause_state.set_user()
        details["pause_reasons"] = self.pause_state.reasons
        wait.answer.resolve(ControlResult(True, "paused (wait)", details))

    def _end_wait_pause(self, result: ControlResult) -> bool:
        """End a "wait" pause still draining (admission reopens), answering `result`;
        True iff there was one."""
        wait, self.wait_pause = self.wait_pause, None
        if wait is None:
            return False
        self.scheduler.open_admission()
        wait.answer.resolve(result)
        return True

    def cancel_wait_pause(self, reason: str) -> bool:
        """End a draining "wait" pause without pausing (continue_generation, shutdown);
        its callers get success false with `reason`."""
        return self._end_wait_pause(ControlResult(False, f"the wait pause did not take "
                                                  f"effect: {reason}",
                                                  {"mode": "wait", "cancelled": True}))

    def resume(self) -> ControlResult:
        """Clear the user's pause only; a hold still active keeps the engine paused. A
        "wait" pause still draining is cancelled (its requests go on, admission reopens)."""
        cancelled = self.cancel_wait_pause("continue_generation came before its requests "
                                           "finished")
        had_user = self.pause_state.clear_user()
        left = self.pause_state.reasons
        if cancelled and not had_user:
            return ControlResult(True, "continued: the pending wait pause is cancelled",
                                 {"cancelled_wait_pause": True, "pause_reasons": left})
        if not had_user and not left:
            return ControlResult(True, "not paused (no-op)",
                                 {"already_running": True, "pause_reasons": left})
        if "memory_released" in left:
            return ControlResult(True, "continued; memory is released: generation starts "
                                 "after resume_memory_occupation",
                                 {"memory_released": sorted(self.released_tags),
                                  "pause_reasons": left})
        if "weights_staged" in left:
            return ControlResult(True, "continued; weights are staged: generation starts "
                                 "after publish_staged_weights or discard_staged_weights",
                                 {"pause_reasons": left})
        return ControlResult(True, "continued", {"pause_reasons": left})

    # ---- device state -------------------------------------------------------------
    @property
    def released_tags(self) -> frozenset[MemoryTag]:
        """Device buffers given back by a memory release: "weights" while the runner has no
        params, "kv_cache" while it has no KV pool (derived from the runner, never stored)."""
        runner = self.runner
        tags: tuple[tuple[MemoryTag, bool], ...] = (("weights", runner.held_params is None),
                                                    ("kv_cache", runner.kv is None))
        return frozenset(tag for tag, gone in tags if gone)

    def set_weight_version(self, version: str) -> dict[str, Any]:
        """New weights are live: outputs carry `version` from now on, and K/V computed with
        the previous weights is invalidated (`Scheduler.invalidate_kv`)."""
        self.weight_version = version
        dropped, kept = self.scheduler.invalidate_kv()
        return {"flushed_cached_pages": dropped, "kept_kv_requests": kept,
                "prefix_cache_enabled": self.cache.enabled}

    # ---- control -------------------------------------------------------------------
    def flush(self) -> ControlResult:
        """Reset the prefix cache and the allocator, refused while any request is live."""
        self.drain()
        blockers = []
        if self.scheduler.waiting:
            blockers.append(f"{len(self.scheduler.waiting)} waiting request(s)")
        running = [r for r in self.scheduler.running if not r.in_prefill]
        if running:
            blockers.append(f"{len(running)} running request(s)")
        if self.scheduler.chunked_reqs:
            blockers.append(f"{len(self.scheduler.chunked_reqs)} chunked prefill(s)")
        if blockers:
            return ControlResult(False, "cannot flush the cache: " + ", ".join(blockers),
                                 {"blockers": blockers})
        # Check the accounting BEFORE the reset: allocator.reset() would hide a leaked page.
        self.scheduler.check_integrity()
        cached = self.cache.num_cached_pages
        self.cache.reset()
        self.allocator.reset()
        self.scheduler.reset_ratio()
        self.forward_ct_decode = 0
        self.last_batch = None
        if self.runner.kv is not None:  # else install_kv makes them anew
            self.runner.reset_prev_ids()
        self.scheduler.check_integrity()
        return ControlResult(True, "cache flushed",
                             {"flushed_cached_pages": cached,
                              "flushed_cached_tokens": cached * self.page_size})
