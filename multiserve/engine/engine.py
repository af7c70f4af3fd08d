"""Engine: the public API of one engine on one device group (exported as multiserve.Engine).

Owns one thread that owns one EngineCore (DESIGN.md §3). Every public method may be
called from any thread: work goes to the engine thread through `self._commands`;
results come back through futures (control) and per-request sinks (outputs).

Invariants:
- Only the engine thread touches the EngineCore, the runner and device state.
- The loop blocks on its queue whenever there is nothing to compute (idle or paused):
  no busy-wait. A control command runs between two steps, never during one.
- An exception in a step marks the engine unhealthy with the reason; every live
  request then ends (finish_reason "abort", `error` set) and new work is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import random
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from multiserve.config import EngineConfig
from multiserve.engine.request import Req
from multiserve.engine.rl_api import RLEngineMixin
from multiserve.engine.setup import EngineParts, build_engine_parts
from multiserve.engine.streams import OutputStream
from multiserve.types import (
    PAUSE_MODES,
    ControlResult,
    EngineUnavailable,
    GenerateRequest,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)


@dataclass
class _Command:
    name: str
    args: tuple
    future: concurrent.futures.Future


class Engine(RLEngineMixin):
    """One inference engine. `Engine(EngineConfig(...))`; see README for examples.
    Memory release/resume and weight updates come from RLEngineMixin (rl_api.py)."""

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
        self._init_rl()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
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

    # ---- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        core = self._core
        while True:
            try:
                block = not self._healthy or not core.has_work()
                while True:
                    try:
                        cmd = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if cmd.name == "stop":
                        self._fail_all("engine shut down")
                        self._close_queue()
                        cmd.future.set_result(ControlResult(True, "stopped"))
                        return
                    self._run_command(cmd)
                    block = False
                if not self._healthy:
                    continue
                if core.has_work() and not core.paused:
                    core.step()
                elif core.in_flight is not None:
                    core.drain()
            except Exception as exc:  # noqa: BLE001 - any step failure isolates the engine
                self._mark_unhealthy(f"{type(exc).__name__}: {exc}")

    def _close_queue(self) -> None:
        """No command is accepted from now on; those queued behind "stop" (a caller that
        raced shutdown) fail instead of waiting forever for a loop that has ended."""
        with self._submit_lock:
            self._closed = True
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd.future.done():
                continue
            if cmd.name == "stop":  # a concurrent second shutdown: already done
                cmd.future.set_result(ControlResult(True, "stopped"))
            else:
                cmd.future.set_exception(EngineUnavailable("engine is shut down"))

    def _run_command(self, cmd: _Command) -> None:
        if cmd.future.done():
            return
        try:
            handler: Callable[..., Any] = getattr(self, f"_cmd_{cmd.name}")
            cmd.future.set_result(handler(*cmd.args))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            cmd.future.set_exception(exc)

    def _mark_unhealthy(self, reason: str) -> None:
        self._healthy = False
        self._reason = reason
        self._core.in_flight = None
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        core = self._core
        for req in list(core.reqs.values()):
            try:
                core.scheduler.remove(req)
            except Exception:  # noqa: BLE001 - state may be broken after a fault
                pass
            core.reqs.pop(req.key, None)
            req.finish_reason = "abort"
            req.status = RequestStatus.FINISHED
            snap = req.snapshot(core.weight_version)
            try:
                req.sink(RequestOutput(**{**snap.__dict__, "error": reason}))
            except Exception:  # noqa: BLE001 - a bad sink must not kill the engine thread
                pass

    # commands (run on the engine thread)
    def _cmd_add(self, reqs: list[Req]) -> None:
        if not self._healthy:
            raise EngineUnavailable(self._reason)
        self._core.add(reqs)

    def _cmd_abort(self, rid: str | None, abort_all: bool) -> ControlResult:
        return self._core.abort(rid, abort_all)

    def _cmd_pause(self, mode: str) -> ControlResult:
        return self._core.pause(mode)

    def _cmd_continue(self) -> ControlResult:
        return self._core.resume()

    def _cmd_flush(self) -> ControlResult:
        return self._core.flush()

    def _cmd_state(self) -> dict[str, Any]:
        return {**self._core.internal_state(), "tp_size": len(self.devices)}

    def _cmd_call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self._core)

    # ---- command plumbing ----------------------------------------------------------
    def _submit(self, name: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._submit_lock:
            if self._stopped or self._closed:
                fut.set_exception(EngineUnavailable("engine is shut down"))
                return fut
            self._commands.put(_Command(name, args, fut))
        return fut

    def _call(self, name: str, *args: Any) -> Any:
        return self._submit(name, *args).result()

    async def _acall(self, name: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(name, *args))

    # ---- requests ------------------------------------------------------------------
    def _make_reqs(self, request: GenerateRequest, sink: Callable[[RequestOutput], None]
                   ) -> list[Req]:
        if not self._healthy:
            raise EngineUnavailable(self._reason)
        ids = list(request.input_ids)
        if not ids:
            raise ValueError("input_ids: the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"input_ids: token ids must be in [0, {vocab})")
        p = request.sampling
        if len(ids) + p.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                f"({p.max_new_tokens}) exceeds the context length {self.context_len}")
        seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
        reqs = [Req(rid=request.rid, index=i, prompt_ids=ids, params=p, seed=seed,
                    sink=sink, stream=request.stream,
                    want_prompt_logprobs=request.return_prompt_logprobs)
                for i in range(p.n)]
        for r in reqs[1:]:
            r.leader = reqs[0]
        return reqs

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._rid_counter)}"

    def _request(self, prompt: str | None, input_ids: Sequence[int] | None,
                 sampling_params: SamplingParams | dict | None, rid: str | None,
                 stream: bool) -> GenerateRequest:
        if isinstance(sampling_params, dict):
            # an sglang sampling dict (its key policy: honoured, no-op or refused by name)
            from multiserve.server.sglang_params import to_sampling_params

            sampling_params = to_sampling_params(sampling_params)
        params = sampling_params or SamplingParams()
        if input_ids is None:
            if prompt is None:
                raise ValueError("give prompt or input_ids")
            input_ids = self.encode(prompt)
        return GenerateRequest(rid=rid or self.new_rid(), input_ids=tuple(input_ids),
                               sampling=params, stream=stream)

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

    def submit(self, request: GenerateRequest,
               sink: Callable[[RequestOutput], None]) -> None:
        """Low-level: enqueue a request; `sink` receives snapshots on the engine thread."""
        self.submit_many([request], [sink])

    def submit_many(self, requests: Sequence[GenerateRequest],
                    sinks: Sequence[Callable[[RequestOutput], None]]) -> None:
        """Enqueue several requests ATOMICALLY: one command to the engine thread, so all of
        them are waiting (or running) before its next step, and a pause or abort issued
        after this returns sees every one of them. Validation of all comes first: if one is
        invalid (or a rid is live already), none is admitted."""
        reqs = [req for request, sink in zip(requests, sinks, strict=True)
                for req in self._make_reqs(request, sink)]
        self._submit("add", reqs).result()

    def stream_sync(self, request: GenerateRequest) -> Iterator[RequestOutput]:
        q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.submit(request, q.put)
        remaining = request.sampling.n
        try:
            while remaining:
                out = q.get()
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
        fut = self._submit("add", reqs)
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
        self._submit("abort", rid, False)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        (st,) = await self.open_streams([request])
        try:
            async for out in st:
                yield out
        finally:
            await st.aclose()

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict]
                 | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 rid: str | None = None) -> Any:
        """Blocking generate. One prompt (text or ids) -> RequestOutput (a list of n
        outputs when n > 1); a list of prompts -> a list of those, all run batched and
        admitted atomically (one engine command: a pause or abort issued once they are
        submitted sees every one). `sampling_params` is one for all prompts or, as sglang
        (and tunix) call it, a list with one per prompt; a dict is sglang's
        `sampling_params` (sglang_params.py)."""
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
        requests = [self._request(p, ids, sp, rid if not batch else None, False)
                    for (p, ids), sp in zip(prompts, per_prompt, strict=True)]
        queues: list[queue.SimpleQueue[RequestOutput]] = [queue.SimpleQueue() for _ in requests]
        self.submit_many(requests, [q.put for q in queues])  # one command: atomic admission
        results = []
        for req, q in zip(requests, queues, strict=True):
            finals: dict[int, RequestOutput] = {}
            while len(finals) < req.sampling.n:
                out = q.get()
                if out.finished:
                    finals[out.index] = self._with_text(out, req.sampling.skip_special_tokens)
            outs = [finals[i] for i in range(req.sampling.n)]
            results.append(outs[0] if req.sampling.n == 1 else outs)
        return results if batch else results[0]

    async def async_generate(self, prompt: str | None = None,
                             sampling_params: SamplingParams | dict | None = None, *,
                             input_ids: Sequence[int] | None = None,
                             rid: str | None = None) -> Any:
        req = self._request(prompt, input_ids, sampling_params, rid, False)
        finals: dict[int, RequestOutput] = {}
        async for out in self.stream(req):
            if out.finished:
                finals[out.index] = self._with_text(out, req.sampling.skip_special_tokens)
        outs = [finals[i] for i in range(req.sampling.n)]
        return outs[0] if req.sampling.n == 1 else outs

    # ---- control: sync -------------------------------------------------------------
    @staticmethod
    def _check_mode(mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {PAUSE_MODES}, got {mode!r}")

    def pause_generation(self, mode: str = "abort") -> ControlResult:
        self._check_mode(mode)
        return self._call("pause", mode)

    def continue_generation(self) -> ControlResult:
        return self._call("continue")

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> ControlResult:
        return self._call("abort", rid, abort_all)

    def flush_cache(self) -> ControlResult:
        return self._call("flush")

    def get_internal_state(self) -> dict[str, Any]:
        return self._call("state")

    def run_on_engine_thread(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(core) on the engine thread between steps (tests and extensions)."""
        return self._call("call", fn)

    # ---- control: async ------------------------------------------------------------
    async def async_pause_generation(self, mode: str = "abort") -> ControlResult:
        self._check_mode(mode)
        return await self._acall("pause", mode)

    async def async_continue_generation(self) -> ControlResult:
        return await self._acall("continue")

    async def async_abort_request(self, rid: str | None = None,
                                  abort_all: bool = False) -> ControlResult:
        return await self._acall("abort", rid, abort_all)

    async def async_flush_cache(self) -> ControlResult:
        return await self._acall("flush")

    async def async_get_internal_state(self) -> dict[str, Any]:
        return await self._acall("state")

    # ---- health / lifecycle --------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self._stopped:
            return False, "engine is shut down"
        released = self._core.released_tags
        if self._healthy and released:
            return True, f"asleep: memory released ({', '.join(sorted(released))})"
        return self._healthy, self._reason

    def inject_fault_for_testing(self, message: str = "injected fault") -> None:
        """Test-only hook: the engine's next step raises RuntimeError(message)."""
        self.run_on_engine_thread(lambda core: setattr(core, "fault", message))

    def shutdown(self) -> None:
        if self._stopped:
            return
        fut = self._submit("stop")
        self._stopped = True
        if self._thread.is_alive():
            fut.result(timeout=60)
            self._thread.join(timeout=60)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
