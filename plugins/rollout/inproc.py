"""Rollout backend over in-process `multiserve.Engine` objects (trainer in the same process).

Uses only the public API: `Engine.submit` (its sink gets deltas; `multiserve.assembling`
turns them into snapshots), `encode`/`decode`, pause/continue/abort, the two-phase weight
update (`stage_weights_from_tensor` -> `publish_staged_weights` /
`discard_staged_weights`) and memory release/resume.

Invariant: a fleet-wide update publishes only if every engine staged; otherwise every
staged copy is discarded and RolloutError names the engines that failed.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from multiserve import assembling
from multiserve.types import ControlResult, GenerateRequest, RequestOutput, SamplingParams
from plugins.rollout.results import RolloutError, RolloutHandle, RolloutResult

Prompt = str | Sequence[int]


class InProcessBackend:
    def __init__(self, engines: Sequence[Any]) -> None:
        assert engines, "need at least one engine"
        self.engines = list(engines)
        self._ids = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.engines))

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- generation --------------------------------------------------------------------
    def start(self, prompts: Sequence[Prompt], sampling: dict[str, Any],
              assign: Sequence[int]) -> RolloutHandle:
        params = SamplingParams(return_logprob=True, **sampling)
        handle = RolloutHandle(len(prompts) * params.n)
        batch = next(self._ids)
        for p, (prompt, e) in enumerate(zip(prompts, assign, strict=True)):
            engine = self.engines[e]
            ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            rid = f"rollout-{batch}-{p}"
            sink = self._sink(handle, engine, e, p, tuple(ids))
            engine.submit(GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=params,
                                          stream=True), assembling(sink))
        return handle

    @staticmethod
    def _sink(handle: RolloutHandle, engine: Any, e: int, p: int,
              prompt_ids: tuple[int, ...]) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:  # runs on the engine thread: stay cheap
            key = (p, out.index)
            if not out.finished:
                handle.progress(key, len(out.output_ids))
                return
            if out.error:
                handle.fail(RolloutError(f"engine {e}: {out.error}"))
                return
            handle.finish(to_result(out, p, prompt_ids, e, engine.decode(out.output_ids)))
        return sink

    # ---- control ---------------------------------------------------------------------------
    def _all(self, fn: Callable[[Any], ControlResult]) -> list[ControlResult]:
        return list(self._pool.map(fn, self.engines))

    @staticmethod
    def _check(name: str, results: list[ControlResult]) -> list[ControlResult]:
        bad = [f"engine {i}: {r.message}" for i, r in enumerate(results) if not r.ok]
        if bad:
            raise RolloutError(f"{name} failed on {len(bad)} engine(s): " + "; ".join(bad))
        return results

    def pause(self, mode: str) -> list[ControlResult]:
        return self._check("pause", self._all(lambda e: e.pause_generation(mode)))

    def resume(self) -> list[ControlResult]:
        return self._check("continue", self._all(lambda e: e.continue_generation()))

    def abort_all(self) -> list[ControlResult]:
        return self._all(lambda e: e.abort_request(abort_all=True))

    def release_memory(self, tags: Any, mode: str, preserve_state: bool) -> list[ControlResult]:
        return self._check("release_memory_occupation", self._all(
            lambda e: e.release_memory_occupation(tags, mode, preserve_state)))

    def resume_memory(self, tags: Any) -> list[ControlResult]:
        return self._check("resume_memory_occupation",
                           self._all(lambda e: e.resume_memory_occupation(tags)))

    def update_params(self, params: Any, version: str,
                      abort_running: bool) -> list[ControlResult]:
        if isinstance(params, str):
            staged = self._all(lambda e: e.stage_weights_from_disk(params, version,
                                                                   abort_running))
        else:
            staged = self._all(lambda e: e.stage_weights_from_tensor(params, version,
                                                                     abort_running))
        bad = [f"engine {i}: {r.message}" for i, r in enumerate(staged) if not r.ok]
        if bad:
            for engine, r in zip(self.engines, staged, strict=True):
                engine.discard_staged_weights(r.details.get("token") if r.ok else None)
            raise RolloutError(f"weight update to {version!r} not applied (every engine keeps "
                               f"its weights): " + "; ".join(bad))
        pairs = list(zip(self.engines, staged, strict=True))
        published = list(self._pool.map(
            lambda er: er[0].publish_staged_weights(er[1].details["token"], abort_running),
            pairs))
        return self._check(f"publishing weights {version!r}", published)

    def weight_versions(self) -> list[str]:
        return [e.get_internal_state()["weight_version"] for e in self.engines]


def to_result(out: RequestOutput, p: int, prompt_ids: tuple[int, ...], engine: int,
              text: str) -> RolloutResult:
    lps = tuple(lp.logprob for lp in (out.logprobs or ()))
    segs = tuple((s.start, s.weight_version) for s in out.weight_segments)
    return RolloutResult(p, out.index, prompt_ids, tuple(out.output_ids), lps, text,
                         out.finish_reason, out.weight_version, segs, engine, out.rid)
