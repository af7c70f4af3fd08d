"""Records of the rollout client: one sample's result, and a batch in flight.

Owns `RolloutResult` (what an RL trainer needs per sample: token ids, per-token logprobs,
text, finish reason, the weight version(s) that produced the tokens) and `RolloutHandle`
(a generation batch running in the background, with progress for "wait until some
tokens exist" and the final results). Plain Python: no multiserve import beyond types.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class RolloutError(RuntimeError):
    """A fleet-wide operation failed; the message names the engine(s) and the reason."""


@dataclass(frozen=True)
class RolloutResult:
    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # logprob of each generated token (raw distribution)
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    weight_version: str  # the version that produced the last token
    segments: tuple[tuple[int, str], ...]  # (first token index, weight version), ascending
    engine: int  # index of the engine that served it
    rid: str

    def version_of_token(self, i: int) -> str:
        """The weight version that produced token i."""
        assert 0 <= i < len(self.token_ids), i
        version = self.segments[0][1] if self.segments else self.weight_version
        for start, v in self.segments:
            if start <= i:
                version = v
        return version

    def continuation_ids(self) -> list[int]:
        """input_ids that resume this (aborted) sample: prompt + tokens so far."""
        return list(self.prompt_ids) + list(self.token_ids)


def merge_resumed(first: RolloutResult, rest: RolloutResult) -> RolloutResult:
    """One result from an aborted sample and its resumption (`rest` was generated from
    `first.continuation_ids()`)."""
    off = len(first.token_ids)
    segs = list(first.segments)
    for start, v in rest.segments:
        if not segs or segs[-1][1] != v:
            segs.append((start + off, v))
    return RolloutResult(
        first.prompt_index, first.sample_index, first.prompt_ids,
        first.token_ids + rest.token_ids, first.logprobs + rest.logprobs,
        first.text + rest.text, rest.finish_reason, rest.weight_version, tuple(segs),
        rest.engine, rest.rid)


class RolloutHandle:
    """A batch in flight. `result()` blocks for every sample; `wait_tokens(k)` blocks until
    some sample has at least k tokens (a progress condition, not a sleep)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._cv = threading.Condition()
        self._results: dict[tuple[int, int], RolloutResult] = {}
        self._progress: dict[tuple[int, int], int] = {}
        self._error: BaseException | None = None
        self.on_cancel: Callable[[], None] | None = None

    # producer side (any thread)
    def progress(self, key: tuple[int, int], num_tokens: int) -> None:
        with self._cv:
            self._progress[key] = max(num_tokens, self._progress.get(key, 0))
            self._cv.notify_all()

    def finish(self, result: RolloutResult) -> None:
        with self._cv:
            key = (result.prompt_index, result.sample_index)
            self._results[key] = result
            self._progress[key] = len(result.token_ids)
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()

    # consumer side
    @property
    def done(self) -> bool:
        with self._cv:
            return len(self._results) >= self.expected or self._error is not None

    def max_tokens_so_far(self) -> int:
        with self._cv:
            return max(self._progress.values(), default=0)

    def wait_tokens(self, k: int, timeout: float = 300.0) -> int:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._error is not None or len(self._results)
                                   >= self.expected or max(self._progress.values(), default=0)
                                   >= k, timeout)
            if self._error is not None:
                raise RolloutError(str(self._error)) from self._error
            assert ok, f"no sample reached {k} tokens within {timeout}s"
            return max(self._progress.values(), default=0)

    def result(self, timeout: float = 600.0) -> list[RolloutResult]:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._error is not None
                                   or len(self._results) >= self.expected, timeout)
            if self._error is not None:
                raise RolloutError(str(self._error)) from self._error
            if not ok:
                raise TimeoutError(f"only {len(self._results)}/{self.expected} samples "
                                   f"finished within {timeout}s")
            return [self._results[k] for k in sorted(self._results)]


def sampling_dict(max_tokens: int, temperature: float, top_p: float, top_k: int,
                  seed: int | None, n: int, stop: Sequence[str] | None,
                  ignore_eos: bool) -> dict[str, Any]:
    """The native (sglang-style) sampling_params for one batch."""
    out: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature,
                           "top_p": top_p, "top_k": top_k, "n": n, "ignore_eos": ignore_eos}
    if seed is not None:
        out["seed"] = seed
    if stop:
        out["stop"] = list(stop)
    return out
