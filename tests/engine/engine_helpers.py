"""Helpers shared by the engine tests: request collection, exact pause points, state checks.

`Collector` submits requests through the public `Engine.submit` and gathers every
snapshot per (rid, index) (assembled from the engine's deltas). `Trigger` starts async
control calls FROM an output sink (that is, on the engine thread, between a step's
results and the next step) and returns only once the calls were handed to the engine, so
a pause lands right after the step that produced a given token: the engine loop runs
every queued command before it steps again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from shipped_engine import SHIPPED_FUSED_STEP_MAX

from multiserve.engine.commands import CheckIntegrity
from multiserve.engine.streams import assembling
from multiserve.types import GenerateRequest, RequestOutput, SamplingParams

TINY_VOCAB = 512  # tiny test model: a small vocabulary keeps the sampler cheap
# EngineConfig fields of the shared tiny engines (conftest): small buckets, chunked
# prefill forced small (32 tokens), 8-token pages, the shipped fused step programs.
TINY_ENGINE: dict[str, Any] = dict(
    precompile_token_paddings=(64, 128), precompile_bs_paddings=(64,),
    max_running_requests=64, chunked_prefill_size=32, page_size=8, max_total_tokens=8192,
    max_context_len=1024, show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)
WAIT_S = 120.0  # upper bound for any single wait in these tests (never reached when healthy)

Key = tuple[str, int]


class Collector:
    """Submits requests and collects their outputs; `on_output(out)` runs on the engine
    thread for every snapshot (after it is recorded)."""

    def __init__(self, engine: Any,
                 on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.snapshots: dict[Key, list[RequestOutput]] = {}
        self.final: dict[Key, RequestOutput] = {}
        self.expected = 0
        self._cv = threading.Condition()

    def _sink(self, out: RequestOutput) -> None:
        with self._cv:
            self.snapshots.setdefault((out.rid, out.index), []).append(out)
            if out.finished:
                assert (out.rid, out.index) not in self.final, f"two final outputs: {out.rid}"
                self.final[(out.rid, out.index)] = out
            self._cv.notify_all()
        if self.on_output is not None:
            self.on_output(out)

    def submit(self, rid: str, input_ids: Sequence[int], params: SamplingParams,
               stream: bool = True, lora_name: str | None = None) -> None:
        with self._cv:
            self.expected += params.n
        self.engine.submit(GenerateRequest(rid=rid, input_ids=tuple(input_ids),
                                           sampling=params, stream=stream,
                                           lora_name=lora_name),
                           assembling(self._sink))

    async def asubmit_all(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                          prefix: str) -> list[str]:
        """`submit_all` from an event loop, as ONE Add command queued before the first
        suspension (so, started from a sink through a Trigger, before the next step)."""
        from multiserve.engine.commands import Add

        rids = [f"{prefix}{i}" for i in range(len(prompts))]
        reqs = []
        for rid, ids in zip(rids, prompts, strict=True):
            with self._cv:
                self.expected += params.n
            reqs += self.engine._make_reqs(GenerateRequest(  # noqa: SLF001 - a test's Add
                rid=rid, input_ids=tuple(ids), sampling=params, stream=True),
                assembling(self._sink))
        await self.engine.acall(Add(reqs))
        return rids

    def submit_all(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[
            SamplingParams], prefix: str = "r", together: bool = True,
                   lora_names: Sequence[str | None] | None = None) -> list[str]:
        """Submit one request per prompt (rids prefix0, prefix1, ...; `lora_names`: each
        one's adapter, None = the base model). `together`: hold the
        engine (in-place pause) while submitting, so all start in the same step and none
        runs ahead of the rest (a slow test thread would otherwise stagger them, and a
        pause hook on r0 could fire before the last request is even submitted)."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        names = list(lora_names) if lora_names is not None else [None] * len(prompts)
        rids = [f"{prefix}{i}" for i in range(len(prompts))]
        with held(self.engine) if together else contextlib.nullcontext():
            for rid, ids, p, name in zip(rids, prompts, plist, names, strict=True):
                self.submit(rid, ids, p, lora_name=name)
        return rids

    def wait(self, timeout: float = WAIT_S) -> dict[Key, RequestOutput]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self.final) < self.expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    progress = {k: len(v[-1].output_ids) for k, v in self.snapshots.items()}
                    raise AssertionError(
                        f"only {len(self.final)}/{self.expected} requests finished within "
                        f"{timeout}s; tokens so far {progress}; engine health "
                        f"{self.engine.health()}")
                self._cv.wait(left)
            return dict(self.final)

    def num_tokens(self, rid: str, index: int = 0) -> int:
        with self._cv:
            snaps = self.snapshots.get((rid, index), [])
            return len(snaps[-1].output_ids) if snaps else 0

    def ids(self, rid: str, index: int = 0) -> tuple[int, ...]:
        return self.final[(rid, index)].output_ids


@contextlib.contextmanager
def held(engine: Any) -> Iterator[None]:
    """Hold the engine still (in-place pause) for the block, e.g. to submit several requests
    that must start in the same step. An engine the test had paused stays paused."""
    paused_here = not engine.pause_generation("in_place").details.get("already_paused")
    try:
        yield
    finally:
        if paused_here:
            assert engine.continue_generation().ok


class Trigger:
    """An asyncio loop on its own thread, used to start async engine calls from a sink.

    `start(*factories)` creates one task per coroutine factory, lets each run until it has
    submitted its command to the engine (the async control API submits before its first
    suspension), and returns futures for their results. Called from a sink, the commands
    are queued before the engine thread resumes, so they all run before the next step."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="test-trigger")
        self._thread.start()

    def start(self, *factories: Callable[[], Coroutine[Any, Any, Any]]
              ) -> list[concurrent.futures.Future]:
        started = threading.Event()
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future()
                                                    for _ in factories]

        async def launch() -> None:
            tasks = [asyncio.ensure_future(f()) for f in factories]
            for task, fut in zip(tasks, futures, strict=True):
                task.add_done_callback(lambda t, fut=fut: _copy_result(t, fut))
            await asyncio.sleep(0)  # every task ran up to its first await: submitted
            started.set()

        asyncio.run_coroutine_threadsafe(launch(), self.loop)
        assert started.wait(WAIT_S), "trigger loop did not start the calls"
        return futures

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def _copy_result(task: asyncio.Task, fut: concurrent.futures.Future) -> None:
    if task.exception() is not None:
        fut.set_exception(task.exception())
    else:
        fut.set_result(task.result())


class AtTokens:
    """A sink hook: when `rid` has produced `k` output tokens (the k-th in a stream
    snapshot), start `factories` through the trigger, once. `results` then holds their
    futures; `fired` is set."""

    def __init__(self, trigger: Trigger, rid: str, k: int,
                 *factories: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.trigger, self.rid, self.k, self.factories = trigger, rid, k, factories
        self.fired = threading.Event()
        self.results: list[concurrent.futures.Future] = []

    def __call__(self, out: RequestOutput) -> None:
        if (not self.fired.is_set() and out.rid == self.rid and out.index == 0
                and len(out.output_ids) >= self.k):
            self.results = self.trigger.start(*self.factories)
            self.fired.set()

    def wait(self, timeout: float = WAIT_S) -> list[Any]:
        assert self.fired.wait(timeout), f"{self.rid} never reached {self.k} tokens"
        return [f.result(timeout=timeout) for f in self.results]


class Oracle:
    """Drafts the true continuation (from a run without speculation); `wrong`: each draft
    token replaced by another id, so every draft is rejected at its first token."""

    def __init__(self, truth: dict[Key, tuple[int, ...]], wrong: bool = False,
                 vocab: int = TINY_VOCAB) -> None:
        self.truth, self.wrong, self.vocab = truth, wrong, vocab
        self.proposed = 0

    def wants(self, req: Any) -> bool:
        return req.key in self.truth

    def propose(self, req: Any, k: int) -> tuple[int, ...]:
        out = self.truth.get(req.key, ())
        n = len(req.output_ids)
        draft = tuple(out[n:n + k])
        self.proposed += len(draft)
        return tuple((t + 1) % self.vocab for t in draft) if self.wrong else draft

    def acceptance(self, req: Any) -> float:
        return 1.0  # both claim certainty: every draft token is worth a verify row

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        pass

    def finished(self, req: Any) -> None:
        pass


class DraftsAlwaysPay:
    """A step-cost stand-in for tests: every draft token is verified (how many pay is a
    timing fact; the tests check what verification does, whatever the count)."""

    overlap = True
    host_seconds = 0.0

    def best_draft_count(self, base_tokens: int, base_rows: int, gains: Any) -> int:
        return len(gains)

    def observe(self, bucket: int, seconds: float) -> None:
        pass

    def observe_host(self, seconds: float) -> None:
        pass


@contextlib.contextmanager
def drafting(engine: Any, drafter: Any) -> Iterator[None]:
    """The engine's scheduler drafts with `drafter` for the block, every draft verified
    (DraftsAlwaysPay: what verification does, whatever the step timings); afterwards it
    has no draft source and its own step-cost model again."""
    from multiserve.engine.commands import Call

    def swap(source: Any, costs: Any) -> Any:
        def run(core: Any) -> Any:
            planner = core.scheduler.planner
            old = planner.step_costs
            planner.set_source(source)
            planner.step_costs = costs
            return old
        return engine.call(Call(run)).result()

    costs = swap(drafter, DraftsAlwaysPay())
    try:
        yield
    finally:
        swap(None, costs)


def ids_and_logprobs(outs: dict) -> dict:
    """(ids, raw logprobs) per sample of a Collector's results, compared exactly: equal ids
    with drifting logprobs would mean the numerics changed (an argmax flip waiting to
    happen)."""
    return {k: (o.output_ids, tuple(t.logprob for t in o.logprobs)) for k, o in outs.items()}


def greedy_and_seeded(max_new: int) -> tuple[SamplingParams, SamplingParams]:
    """A greedy and a seeded (temperature 0.9, top-p 0.95, seed 7) request's params:
    `max_new` tokens exactly, logprobs returned."""
    return (SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True,
                           return_logprob=True),
            SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=max_new,
                           ignore_eos=True, return_logprob=True))


def run_alternating(engine: Any, prompts: Sequence[Sequence[int]],
                    params: tuple[SamplingParams, SamplingParams],
                    hook: Callable[[RequestOutput], None] | None = None) -> dict:
    """`ids_and_logprobs` of `prompts` submitted together, request i with params[i % 2]
    (greedy and seeded in turns); `hook` as Collector's `on_output`."""
    col = Collector(engine, on_output=hook)
    col.submit_all(prompts, [params[i % 2] for i in range(len(prompts))])
    return ids_and_logprobs(col.wait())


def passes_settled(engine: Any, passes: int = 2) -> dict[str, Any]:
    """Wait (by round trips, not by time) until the engine loop has completed `passes` more
    passes, each of which decides whether to step; returns the last internal state. Every
    GetState runs on the loop between two such decisions, so once the count has moved by
    `passes`, a step the loop was going to take (wrongly, when paused) has been taken."""
    start = engine.get_internal_state()["loop_passes"]
    while True:
        state = engine.get_internal_state()
        if state["loop_passes"] >= start + passes:
            return state


def assert_idle_and_clean(engine: Any) -> None:
    """The engine holds no request and no KV beyond an unreferenced prefix cache; after a
    flush every KV token is available again (the memory-integrity contract)."""
    engine.call(CheckIntegrity()).result()
    st = engine.get_internal_state()
    assert not st["engine_paused"], "the test left the engine paused"
    assert st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0, st
    assert st["req_to_token_pool_used"] == 0, st
    assert st["cache_miss_count"] == 0, "a step shape was compiled after warm-up"
    assert st["tree_cache_size"] == st["evictable_kv_tokens"], st  # nothing referenced
    assert st["available_kv_tokens"] + st["evictable_kv_tokens"] == \
        st["initial_available_kv_tokens"], st
    res = engine.flush_cache()
    assert res.ok, res
    st = engine.get_internal_state()
    assert st["available_kv_tokens"] == st["initial_available_kv_tokens"], st
    assert st["tree_cache_size"] == 0, st


def restore(engine: Any) -> None:
    """Best effort: leave an engine unpaused with no live request (after a failed test)."""
    engine.continue_generation()
    engine.abort_request(abort_all=True)


class ReferenceModel:
    """The model's plain unbatched generation loop: one sequence, its own KV pool, the
    prompt in one forward, then one token per forward; no scheduler, no prefix cache, no
    chunking, no other request. Steps are padded like `simple_generate.greedy_token_ids`
    (power-of-two token counts, one logits row); the model is row-invariant, so it shares
    the engine's numerics bit for bit. Unlike it, the page table has one fixed width, so
    the loop compiles once per token bucket."""

    PAGE_SIZE = 16

    def __init__(self, model_path: str | None, max_len: int = 1024) -> None:
        import jax
        import numpy as np

        from multiserve.model.families.forward import forward
        from multiserve.model.invariance.calibration import default_plan
        from multiserve.model.invariance.primitives import with_transposed
        from multiserve.model.loading.loader import load_model

        loaded = load_model(model_path, np.float32)
        self.cfg = loaded.config
        self.params = with_transposed(jax.device_put(loaded.params), loaded.config,
                                      stacked_t=True)
        self.max_pages = -(-max_len // self.PAGE_SIZE)
        cfg = self.cfg
        # the plan of a default engine on this machine: its numerics, bit for bit
        plan = default_plan(cfg, np.float32, page_size=self.PAGE_SIZE, block_size=128)
        self._fwd = jax.jit(lambda p, kv, b: forward(p, kv, b, cfg, page_size=self.PAGE_SIZE,
                                                     attn_block_size=128, plan=plan),
                            donate_argnums=(1,))

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        import numpy as np

        return self.run(prompt, max_new_tokens, lambda x, _: int(np.argmax(x)))[0]

    def run(self, prompt: Sequence[int], max_new_tokens: int,
            choose: Callable[[Any, list[int]], int]) -> tuple[list[int], list[Any]]:
        """choose(raw logits f32[V] numpy, output so far) -> next id. Returns (ids,
        per-step raw log-softmax rows)."""
        import numpy as np

        from multiserve.model.layers.kv_pool import make_kv_pool
        from multiserve.model.simple_generate import single_sequence_batch

        ps = self.PAGE_SIZE
        assert len(prompt) + max_new_tokens <= self.max_pages * ps
        pages = np.arange(1, self.max_pages + 1, dtype=np.int32)
        kv = make_kv_pool(self.cfg, self.max_pages + 1, ps, np.float32)
        out: list[int] = []
        logprobs: list[Any] = []
        piece, start = list(prompt), 0
        while len(out) < max_new_tokens:
            logits, kv = self._fwd(self.params, kv,
                                   single_sequence_batch(piece, start, pages, ps))
            row = np.asarray(logits[0], np.float32)
            shifted = row - row.max()
            logprobs.append(shifted - np.log(np.exp(shifted).sum()))
            tok = int(choose(row, out))
            out.append(tok)
            start += len(piece)
            piece = [tok]
        return out, logprobs
