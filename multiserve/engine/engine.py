"""Engine: the public API of one engine on one device group (exported as multiserve.Engine).

Owns one thread that owns one EngineCore (docs/architecture.md §3). Every public method may be
called from any thread: work goes to the engine thread as a typed command
(engine/commands.py) through `call(cmd) -> Future` / `await acall(cmd)`; the thread runs
each through one `match` (`_dispatch`). Results come back through those futures (control)
and per-request sinks (outputs). Every control operation (multiserve/control_ops.py: OPS)
runs through `control(name, **args)` / `await acontrol(name, **args)`; the few users call
by name (pause_generation, flush_cache, update_weights_from_disk, ...) are one-line
spellings of it.

Invariants:
- Only the engine thread touches the EngineCore, the runner and device state.
- The loop blocks on its queue whenever there is nothing to compute (idle or paused):
  no busy-wait. A control command runs between two steps, never during one.
- An exception in a step marks the engine unhealthy with the reason; every live
  request then ends (finish_reason "abort", `error` set) and new work is refused.
- At interpreter exit every engine not shut down is shut down (`_shutdown_live_engines`)
  before jax's own exit hook and before finalization: its (daemon) thread would otherwise
  still be inside XLA then, and the process would abort instead of exiting with its status.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import itertools
import queue
import random
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from multiserve.config import EngineConfig
from multiserve.control_ops import (
    AbortRequest,
    ContinueGeneration,
    FlushCache,
    GetInternalState,
    ListLoraAdapters,
    PauseGeneration,
    UnloadLoraAdapter,
    control_request,
)
from multiserve.engine import lora_control
from multiserve.engine.base.lora_adapters import LoraRefused
from multiserve.engine.commands import (
    RL_COMMANDS,
    Add,
    Call,
    CheckIntegrity,
    Command,
    InjectFault,
    InstallLora,
    MarkUnhealthy,
    Prime,
    SetOverlap,
    SetSpeculation,
    StepInfo,
    Stop,
)
from multiserve.engine.control_runner import ControlRunner
from multiserve.engine.lora_control import LoraOperations
from multiserve.engine.rl_interface import RLInterface
from multiserve.engine.sched.request import Req
from multiserve.engine.setup import EngineParts, build_engine_parts
from multiserve.engine.state_report import internal_state, step_info
from multiserve.engine.streams import OutputAssembler, OutputStream
from multiserve.engine.wait_pause import Pending
from multiserve.sampling_policy import to_sampling_params
from multiserve.types import (
    MEMORY_TAGS,
    ControlResult,
    EngineUnavailable,
    GenerateRequest,
    InvalidRequest,
    OutputDelta,
    RequestOutput,
    SamplingParams,
    asleep_reason,
    is_asleep,
)

_Queued = tuple[Command, concurrent.futures.Future]

_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()  # engines not shut down
_LIVE_LOCK = threading.Lock()
_EXIT_HOOK_REGISTERED = False


def _shutdown_live_engines() -> None:
    """Shut down every engine not shut down yet (interpreter exit): its step or priming in
    progress finishes, its requests end with "abort", its thread ends, and no background
    compile starts any more (programs.py's exit hook, which runs after this one, waits
    for a compile in progress)."""
    with _LIVE_LOCK:
        engines = list(_LIVE)
    for engine in engines:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway: the next engine still stops
            pass


def _register_exit_hook() -> None:
    """Register `_shutdown_live_engines` at exit, once, when the first engine is built: jax
    is imported by then and atexit runs hooks last-in first-out, so it runs before jax's
    own hook (which drops the backends) and before programs.py's."""
    global _EXIT_HOOK_REGISTERED
    with _LIVE_LOCK:
        if _EXIT_HOOK_REGISTERED:
            return
        _EXIT_HOOK_REGISTERED = True
    atexit.register(_shutdown_live_engines)


class Engine:
    """One inference engine. `Engine(EngineConfig(...))`; see README for examples.
    Control operations run through `control` / `acontrol`, driven by its ControlRunner
    (engine/control_runner.py)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        cfg = (config or EngineConfig()).with_updates(**overrides) if overrides else (
            config or EngineConfig())
        self.config = cfg
        parts: EngineParts = build_engine_parts(cfg)
        self._parts = parts
        self.model_config = parts.model_cfg
        self.tokenizer = parts.tokenizer
        self.tokenizer_dir = parts.tokenizer_dir
        self.model_path = parts.model_path
        self.model_name = cfg.served_model_name or parts.model_name
        self.context_len = parts.core.max_context
        self.devices = parts.runner.devices
        self._core = parts.core
        self._control_runner = ControlRunner(
            RLInterface(parts.core), self.call, self._require_healthy,
            LoraOperations(parts.model_cfg, cfg.max_lora_rank))
        self._commands: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self._seed_rng = random.Random(cfg.seed)
        self._rid_counter = itertools.count()
        self._healthy = True
        self._reason = "ok"
        self._stopped = False
        self._closed = False  # set by the engine thread at stop, under _submit_lock
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{cfg.device_indexes}",
                                        daemon=True)
        self._thread.start()
        with _LIVE_LOCK:
            _LIVE.add(self)
        _register_exit_hook()
        # programs compiled in the background are primed on the engine thread, between steps
        parts.runner.programs.set_primer(lambda kind, size: self.call(Prime(kind, size)))
        try:
            for entry in cfg.lora_paths:  # name=path, or a path named by itself
                name, _, path = entry.rpartition("=")
                loaded = self.load_lora_adapter(name or path, path)
                if not loaded.ok:
                    raise LoraRefused(loaded.details["error_kind"],
                                      f"lora_paths {entry!r}: {loaded.message}")
        except BaseException:
            self.shutdown()
            raise

    # ---- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        core = self._core
        while True:
            try:
                core.settle_wait_pause()  # before deciding to block: it may pause now
                block = not self._healthy or not core.has_work()
                ran_command = False
                while True:
                    try:
                        cmd, future = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if isinstance(cmd, Stop):
                        core.fail_all("engine shut down")
                        core.cancel_wait_pause("the engine shut down")
                        self._close_queue()
                        future.set_result(ControlResult(True, "stopped"))
                        return
                    self._run_command(cmd, future)
                    ran_command, block = True, False
                core.loop_passes += 1
                if not self._healthy:
                    continue
                if core.has_work() and not core.pause_state.paused:
                    core.step()
                elif core.in_flight is not None:
                    core.drain()
                elif not ran_command:
                    core.empty_passes += 1  # a wake-up with nothing to do: a busy-wait
            except Exception as exc:  # noqa: BLE001 - any step failure isolates the engine
                self._mark_unhealthy(f"{type(exc).__name__}: {exc}")

    def _close_queue(self) -> None:
        """No command is accepted from now on; those queued behind "stop" (a caller that
        raced shutdown) fail instead of waiting forever for a loop that has ended."""
        with self._submit_lock:
            self._closed = True
        while True:
            try:
                cmd, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.done():
                continue
            if isinstance(cmd, Stop):  # a concurrent second shutdown: already done
                future.set_result(ControlResult(True, "stopped"))
            else:
                future.set_exception(EngineUnavailable("engine is shut down"))

    def _run_command(self, cmd: Command, future: concurrent.futures.Future) -> None:
        if future.done():
            return
        try:
            result = self._dispatch(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            future.set_exception(exc)
            return
        if isinstance(result, Pending):  # answered later by the engine thread ("wait")
            result.then(lambda r: None if future.done() else future.set_result(r))
        else:
            future.set_result(result)

    def _dispatch(self, cmd: Command) -> Any:
        """Run one command on the engine thread (between two steps): the one place."""
        core = self._core
        match cmd:
            case Add(reqs):
                self._require_healthy()
                return core.add(reqs)
            case AbortRequest(rid, abort_all):
                return core.abort(rid, abort_all)
            case PauseGeneration(mode, clear_cache):
                return core.pause(mode, clear_cache)
            case ContinueGeneration():
                return core.resume()
            case FlushCache():
                return core.flush()
            case GetInternalState():
                return {**internal_state(core, self._parts.kv_pool),
                        "tp_size": len(self.devices)}
            case Prime(kind, size):
                return core.runner.programs.prime(kind, size)
            case CheckIntegrity():
                return core.scheduler.check_integrity()
            case InjectFault(message):
                return core.inject_fault(message)
            case MarkUnhealthy(reason):
                return self._mark_unhealthy(reason)
            case SetOverlap(on):
                return core.set_overlap(on)
            case SetSpeculation(on):
                return core.set_speculation(on)
            case StepInfo():
                return step_info(core.runner)
            case Call(fn):
                return fn(core)
            case InstallLora(adapter, replace):
                return lora_control.install(core, adapter, replace)
            case UnloadLoraAdapter(name):
                return lora_control.unload(core, name)
            case ListLoraAdapters():
                return lora_control.listing(core)
            case _ if isinstance(cmd, RL_COMMANDS):
                return self._control_runner.execute(cmd)
            case _:  # Stop is handled by the loop itself
                raise TypeError(f"not an engine command: {cmd!r}")

    def mark_unhealthy(self, reason: str) -> None:
        """From any thread: unhealthy now (health answers `reason`, new work is refused);
        the engine thread fails every live request with `reason` when it next runs a
        command (at once unless it is inside a step). Used when a host of an engine
        spanning hosts is lost (multiserve/fleet/slice_start.py)."""
        self._reason = reason
        self._healthy = False
        self.call(MarkUnhealthy(reason))

    def _mark_unhealthy(self, reason: str) -> None:
        self._healthy = False
        self._reason = reason
        self._core.fail_all(reason)

    # ---- commands: the one way into the engine thread -------------------------------
    def call(self, cmd: Command) -> concurrent.futures.Future:
        """Queue `cmd` (engine/commands.py) for the engine thread; the future holds its
        result (or exception). Fails at once (EngineUnavailable) after shutdown."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._submit_lock:
            if self._stopped or self._closed:
                fut.set_exception(EngineUnavailable("engine is shut down"))
                return fut
            self._commands.put((cmd, fut))
        return fut

    async def acall(self, cmd: Command) -> Any:
        """`call(cmd)`, awaited."""
        return await asyncio.wrap_future(self.call(cmd))

    # ---- requests ------------------------------------------------------------------
    def _make_reqs(self, request: GenerateRequest, sink: Callable[[OutputDelta], None]
                   ) -> list[Req]:
        self._require_healthy()
        ids = list(request.input_ids)
        # the one place a request is checked against the served model (types.InvalidRequest;
        # the HTTP side only checks JSON shapes and maps these to its own field names)
        if not ids:
            raise InvalidRequest("input_ids: the prompt is empty", "input_ids")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(f"input_ids: token ids must be in [0, {vocab})", "input_ids")
        p = request.sampling
        if len(ids) >= self.context_len:
            raise InvalidRequest(
                f"input_ids: the prompt has {len(ids)} tokens, but the context length is "
                f"{self.context_len} tokens (room is needed for at least one new token)",
                "input_ids", "context_length_exceeded")
        if len(ids) + p.max_new_tokens > self.context_len:
            raise InvalidRequest(
                f"max_new_tokens: the prompt ({len(ids)} tokens) + max_new_tokens "
                f"({p.max_new_tokens}) = {len(ids) + p.max_new_tokens} exceeds the context "
                f"length ({self.context_len})", "max_new_tokens", "context_length_exceeded")
        if request.return_routed_experts:
            self._check_routed_experts(request)
        if request.cache_salt is not None and (not isinstance(request.cache_salt, str)
                                               or not request.cache_salt):
            raise InvalidRequest("cache_salt: must be a non-empty string (or absent)",
                                 "cache_salt")
        seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
        return Req.samples_of(request, seed, sink)

    def _check_routed_experts(self, request: GenerateRequest) -> None:
        """A request for routing replay needs a MoE model, an engine started with
        enable_return_routed_experts (SGLang refuses it without its server flag too) and a
        start within the prompt."""
        cfg = self.model_config
        if not cfg.moe_layers:
            raise InvalidRequest(
                f"return_routed_experts: routed experts exist only in mixture-of-experts "
                f"models; {self.model_name} ({cfg.architecture}) is dense",
                "return_routed_experts")
        if not self.config.enable_return_routed_experts:
            raise InvalidRequest(
                "return_routed_experts: this server was not started with "
                "--enable-return-routed-experts (the engine option "
                "enable_return_routed_experts), so it does not capture routed experts",
                "return_routed_experts")
        start, n = request.routed_experts_start_len, len(request.input_ids)
        if not 0 <= start <= n:
            raise InvalidRequest(
                f"routed_experts_start_len: must be in [0, {n}] (the prompt's length), "
                f"got {start}", "routed_experts_start_len")

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._rid_counter)}"

    def _request(self, prompt: str | None, input_ids: Sequence[int] | None,
                 sampling_params: SamplingParams | dict | None, rid: str | None,
                 stream: bool, lora_name: str | None = None,
                 return_routed_experts: bool = False,
                 routed_experts_start_len: int = 0) -> GenerateRequest:
        if isinstance(sampling_params, dict):
            # an sglang sampling dict (its key policy: honoured, no-op or refused by name)
            sampling_params = to_sampling_params(sampling_params)
        params = sampling_params or SamplingParams()
        if input_ids is None:
            if prompt is None:
                raise ValueError("give prompt or input_ids")
            input_ids = self.encode(prompt)
        return GenerateRequest(rid=rid or self.new_rid(), input_ids=tuple(input_ids),
                               sampling=params, stream=stream, lora_name=lora_name,
                               return_routed_experts=return_routed_experts,
                               routed_experts_start_len=routed_experts_start_len)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def _with_text(self, out: RequestOutput, skip_special_tokens: bool) -> RequestOutput:
        text = self.decode(out.output_ids, skip_special_tokens)
        return RequestOutput(**{**out.__dict__, "text": text})

    def submit(self, request: GenerateRequest, sink: Callable[[OutputDelta], None]) -> None:
        """Low-level: enqueue a request; `sink` receives its `OutputDelta`s on the engine
        thread (wrap it in `engine.streams.assembling` for cumulative snapshots)."""
        self.submit_many([request], [sink])

    def submit_many(self, requests: Sequence[GenerateRequest],
                    sinks: Sequence[Callable[[OutputDelta], None]]) -> None:
        """Enqueue several requests ATOMICALLY: one command to the engine thread, so all of
        them are waiting (or running) before its next step, and a pause or abort issued
        after this returns sees every one of them. Validation of all comes first: if one is
        invalid (or a rid is live already), none is admitted."""
        reqs = [req for request, sink in zip(requests, sinks, strict=True)
                for req in self._make_reqs(request, sink)]
        self.call(Add(reqs)).result()

    def stream_sync(self, request: GenerateRequest) -> Iterator[RequestOutput]:
        q: queue.SimpleQueue[OutputDelta] = queue.SimpleQueue()
        self.submit(request, q.put)
        assemble = OutputAssembler()
        remaining = request.sampling.n
        try:
            while remaining:
                out = assemble(q.get())
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            if remaining:
                self.abort_request(request.rid)

    async def open_streams(self, requests: Sequence[GenerateRequest]) -> list[OutputStream]:
        """Admit `requests` atomically (like `submit_many`) and return one OutputStream per
        request, in order. Raises if any is refused (then none was admitted). Closing a
        stream before it ended aborts its request."""
        loop = asyncio.get_running_loop()
        streams = [OutputStream(r.rid, r.sampling.n, loop, self._abort_later)
                   for r in requests]
        reqs = [req for request, st in zip(requests, streams, strict=True)
                for req in self._make_reqs(request, st.sink)]
        fut = self.call(Add(reqs))
        try:
            # shielded: cancelling must never cancel the command itself (the engine thread
            # may be running it); aborts queued behind it clean up instead (FIFO).
            await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            for r in requests:
                self._abort_later(r.rid)
            raise
        return streams

    def _abort_later(self, rid: str) -> None:
        self.call(AbortRequest(rid))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        (st,) = await self.open_streams([request])
        assemble = OutputAssembler()
        try:
            async for delta in st:
                yield assemble(delta)
        finally:
            await st.aclose()

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict]
                 | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 rid: str | None = None,
                 lora_name: str | None | Sequence[str | None] = None,
                 return_routed_experts: bool = False,
                 routed_experts_start_len: int = 0) -> Any:
        """Blocking generate. One prompt (text or ids) -> RequestOutput (a list of n
        outputs when n > 1); a list of prompts -> a list of those, all run batched and
        admitted atomically (one engine command: a pause or abort issued once they are
        submitted sees every one). `sampling_params` is one for all prompts or, as sglang
        (and tunix) call it, a list with one per prompt; a dict is sglang's
        `sampling_params` (multiserve/sampling_policy.py). `lora_name`: the loaded LoRA
        adapter to run with (None: the base model), one for all prompts or one per
        prompt. `return_routed_experts` (a MoE model on an engine with
        enable_return_routed_experts): each output's `routed_experts`
        (types.RoutedExperts) from `routed_experts_start_len` on."""
        batch = (isinstance(prompt, (list, tuple)) or
                 (input_ids is not None and len(input_ids) > 0
                  and isinstance(input_ids[0], (list, tuple))))
        prompts: list[tuple[str | None, Sequence[int] | None]]
        if batch:
            prompts = ([(p, None) for p in prompt] if prompt is not None  # type: ignore[union-attr]
                       else [(None, ids) for ids in input_ids])  # type: ignore[union-attr]
        else:
            prompts = [(prompt, input_ids)]  # type: ignore[list-item]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: need one per prompt, got "
                                 f"{len(sampling_params)} for {len(prompts)} prompt(s)")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params] * len(prompts)
        loras = (list(lora_name) if isinstance(lora_name, (list, tuple))
                 else [lora_name] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_name: need one per prompt, got {len(loras)} for "
                             f"{len(prompts)} prompt(s)")
        requests = [self._request(p, ids, sp, rid if not batch else None, False, lora,
                                  return_routed_experts, routed_experts_start_len)
                    for (p, ids), sp, lora in zip(prompts, per_prompt, loras, strict=True)]
        queues: list[queue.SimpleQueue[OutputDelta]] = [queue.SimpleQueue() for _ in requests]
        self.submit_many(requests, [q.put for q in queues])  # one command: atomic admission
        results = []
        assemble = OutputAssembler()
        for req, q in zip(requests, queues, strict=True):
            finals: dict[int, RequestOutput] = {}
            while len(finals) < req.sampling.n:
                out = assemble(q.get())
                if out.finished:
                    finals[out.index] = self._with_text(out, req.sampling.skip_special_tokens)
            outs = [finals[i] for i in range(req.sampling.n)]
            results.append(outs[0] if req.sampling.n == 1 else outs)
        return results if batch else results[0]

    async def async_generate(self, prompt: str | None = None,
                             sampling_params: SamplingParams | dict | None = None, *,
                             input_ids: Sequence[int] | None = None,
                             rid: str | None = None, lora_name: str | None = None,
                             return_routed_experts: bool = False,
                             routed_experts_start_len: int = 0) -> Any:
        req = self._request(prompt, input_ids, sampling_params, rid, False, lora_name,
                            return_routed_experts, routed_experts_start_len)
        finals: dict[int, RequestOutput] = {}
        async for out in self.stream(req):
            if out.finished:
                finals[out.index] = self._with_text(out, req.sampling.skip_special_tokens)
        outs = [finals[i] for i in range(req.sampling.n)]
        return outs[0] if req.sampling.n == 1 else outs

    # ---- control: every operation of control_ops.OPS ------------------------------------
    def control(self, name: str, /, **args: Any) -> Any:
        """Run control operation `name` (multiserve/control_ops.py) with its arguments and
        wait for its answer (a ControlResult; get_internal_state: a dict). A bad argument
        raises ValueError here, before anything runs."""
        runner = self._control_runner
        return runner.run(runner.operation(control_request(name, **args)))

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        """`control(name, **args)`, awaited (a staging's reads run in a worker thread)."""
        runner = self._control_runner
        return await runner.arun(runner.operation(control_request(name, **args)))

    # the operations Python callers name (sglang's Engine methods), as one-line spellings
    def pause_generation(self, mode: str = "abort", clear_cache: bool = False
                         ) -> ControlResult:
        """sglang's modes (abort, retract, in_place) and vLLM's (abort, keep, wait)."""
        return self.control("pause_generation", mode=mode, clear_cache=clear_cache)

    def continue_generation(self) -> ControlResult:
        return self.control("continue_generation")

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> ControlResult:
        return self.control("abort_request", rid=rid, abort_all=abort_all)

    def flush_cache(self) -> ControlResult:
        return self.control("flush_cache")

    def get_internal_state(self) -> dict[str, Any]:
        return self.control("get_internal_state")

    # ---- health / lifecycle --------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self._stopped:
            return False, "engine is shut down"
        released = self._core.released_tags
        if self._healthy and released:
            return True, asleep_reason(released)
        return self._healthy, self._reason

    def accepts_work(self) -> tuple[bool, str]:
        """(whether a request sent now would run now, why not): healthy, memory resident,
        not paused and no "wait" pause draining. Any thread: like `health`, a read of two
        references the engine thread replaces or empties between commands (the pause
        reasons' truthiness, the draining wait pause), so it may be one command behind."""
        ok, reason = self.health()
        if not ok or is_asleep(reason):
            return False, reason
        core = self._core
        if core.pause_state.paused:
            return False, "paused"
        if core.wait_pause is not None:
            return False, "pausing (wait): admission is closed"
        return True, "ok"

    def shutdown(self) -> None:
        if self._stopped:
            return
        fut = self.call(Stop())
        self._stopped = True
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self._parts.runner.programs.stop()  # no further compile starts (none waited for)
        if self._thread.is_alive():
            fut.result(timeout=60)
            self._thread.join(timeout=60)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until every step program is compiled (True), or the timeout ends (False).
        The engine serves before that (EngineConfig.compile_in_background): with the same
        outputs, but its smaller steps run padded to larger buckets until then. Benchmarks
        wait here; get_internal_state()["compile"] shows the progress."""
        return self._parts.runner.programs.wait_complete(timeout)

    def compile_status(self) -> dict[str, Any]:
        """The step programs' compile progress (also get_internal_state()["compile"]):
        ready_s / complete_s (seconds from warm-up start to serving / to every bucket),
        compiled and pending buckets ("T=<tokens>", "R=<rows>"), a background error, and
        whether the background thread still runs. Readable from any thread, also after
        shutdown."""
        return dataclasses.asdict(self._parts.runner.programs.status())

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _require_healthy(self) -> None:
        if not self._healthy:
            raise EngineUnavailable(self._reason)

    # ---- LoRA adapters (engine/lora_control.py, model/layers/lora.py) -------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, *,
                          tensors: Mapping[str, Any] | None = None, r: int | None = None,
                          lora_alpha: float | None = None, use_rslora: bool = False,
                          target_modules: Any = None, load_inplace: bool = False
                          ) -> ControlResult:
        """Load a LoRA adapter into a free slot, from a PEFT directory (`lora_path`:
        load_lora_adapter) or from PEFT-named in-memory tensors (`tensors`, with `r`,
        `lora_alpha` (default r), `use_rslora`, `target_modules`:
        load_lora_adapter_from_tensors). Checked before anything is written; a refusal is
        ok=False with details["error_kind"] ("invalid", "exists", "full"), nothing loaded.
        `load_inplace`: an adapter of that name already loaded is replaced; live requests
        finish on the version they were admitted with (EngineCore.load_lora). No program
        recompiles. details: name, slot, rank, replaced, loaded_adapters."""
        if (lora_path is None) == (tensors is None):
            raise ValueError("load_lora_adapter: give lora_path or tensors (one of them)")
        if lora_path is not None:
            return self.control("load_lora_adapter", lora_name=lora_name, lora_path=lora_path,
                                load_inplace=load_inplace)
        if r is None:
            raise ValueError("load_lora_adapter: r, the adapter's rank, is required with "
                             "tensors")
        return self.control("load_lora_adapter_from_tensors", lora_name=lora_name,
                            tensors=tensors, r=r, lora_alpha=lora_alpha,
                            use_rslora=use_rslora, target_modules=target_modules,
                            load_inplace=load_inplace)

    def unload_lora_adapter(self, lora_name: str) -> ControlResult:
        """Free an adapter's slot; refused (ok=False) with error_kind "unknown", or
        "in_use" (with the number of live requests using it) while requests run with it."""
        return self.control("unload_lora_adapter", lora_name=lora_name)

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters (list_lora_adapters' details["adapters"]): name, slot,
        rank, scale, target_modules, source."""
        return self.control("list_lora_adapters").details["adapters"]

    # ---- RL: weight updates and memory release (control_ops.py's records say more) ------
    def stage_weights_from_tensor(self, params: Any, weight_version: str,
                                  abort_running: bool = False) -> ControlResult:
        """Validate + copy `params` (flat {HF name: array}, (name, array) pairs, or the
        params pytree; a subset updates only those tensors) onto the engine's devices.
        details["token"] publishes it. Refused if requests run and the engine is not
        paused (unless abort_running). The engine is held paused until publish/discard."""
        return self.control("stage_weights_from_tensor", params=params,
                            weight_version=weight_version, abort_running=abort_running)

    def stage_weights_from_disk(self, path: str, weight_version: str,
                                abort_running: bool = False) -> ControlResult:
        """Like stage_weights_from_tensor, from an HF safetensors dir (every tensor)."""
        return self.control("stage_weights_from_disk", path=path,
                            weight_version=weight_version, abort_running=abort_running)

    def publish_staged_weights(self, token: str, abort_running: bool = False) -> ControlResult:
        """Swap the staged weights in (between two steps), set the version, invalidate
        the prefix cache; abort_running aborts every live request first."""
        return self.control("publish_staged_weights", token=token, abort_running=abort_running)

    def discard_staged_weights(self, token: str | None = None) -> ControlResult:
        """Drop the staged weights (`token`, or whichever are staged); the engine runs
        again unless another reason holds it."""
        return self.control("discard_staged_weights", token=token)

    def update_weights_from_tensor(self, params: Any, weight_version: str,
                                   abort_running: bool = False) -> ControlResult:
        """stage_weights_from_tensor, then publish_staged_weights."""
        return self.control("update_weights_from_tensor", params=params,
                            weight_version=weight_version, abort_running=abort_running)

    def update_weights_from_arrays(self, params: Any, weight_version: str,
                                   abort_running: bool = False) -> ControlResult:
        """update_weights_from_tensor for an in-process trainer's jax.Arrays (flat {HF
        name: array} or the params pytree): each of exactly the served dtype, resharded
        device to device onto the engine's shardings (jax.device_put: no host copy, no
        cast, bit for bit), validated by name and shape, published atomically as
        `weight_version`."""
        return self.control("update_weights_from_arrays", params=params,
                            weight_version=weight_version, abort_running=abort_running)

    def update_weights_from_disk(self, path: str, weight_version: str,
                                 abort_running: bool = False) -> ControlResult:
        """stage_weights_from_disk, then publish_staged_weights."""
        return self.control("update_weights_from_disk", path=path,
                            weight_version=weight_version, abort_running=abort_running)

    # the weight-update session (tpu-inference's names; engine/rl/session.py)
    def start_weight_update(self, free_kv_cache: bool = True, abort_running: bool = False
                            ) -> ControlResult:
        """Open a session: the engine is held for one update (pause it first, or
        abort_running); `free_kv_cache` (tpu-inference's default) releases the KV pool
        until finish_weight_update."""
        return self.control("start_weight_update", free_kv_cache=free_kv_cache,
                            abort_running=abort_running)

    def update_weights(self, update_info: dict[str, Any]) -> ControlResult:
        """Stage one checkpoint into the session: {"path": an HF safetensors dir} or
        {"params": tensors} (flat HF names -> arrays, or the params pytree)."""
        return self.control("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> ControlResult:
        """Publish the session's checkpoint as `weight_version`; the answer names it."""
        return self.control("finish_weight_update", weight_version=weight_version)

    def abort_weight_update(self) -> ControlResult:
        return self.control("abort_weight_update")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> ControlResult:
        """details: name, shape (HF orientation), dtype, values = the first
        `truncate_size` rows as nested lists, weight_version."""
        return self.control("get_weights_by_name", name=name, truncate_size=truncate_size)

    def release_memory_occupation(self, tags: Any = MEMORY_TAGS, mode: str = "retract",
                                  preserve_state: bool = False) -> ControlResult:
        """Hold the engine (applying `mode` if it runs), then free the tagged device
        buffers; new requests wait until resume. preserve_state keeps in-place paused
        requests' K/V on the host and restores it exactly."""
        return self.control("release_memory_occupation", tags=tags, mode=mode,
                            preserve_state=preserve_state)

    def resume_memory_occupation(self, tags: Any = MEMORY_TAGS) -> ControlResult:
        """Bring the tagged device buffers back; generation starts again once everything
        is resident and nothing else holds the engine."""
        return self.control("resume_memory_occupation", tags=tags)
