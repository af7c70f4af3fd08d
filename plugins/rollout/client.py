"""RolloutClient: what an RL trainer calls to generate on, and re-weight, a multiserve fleet.

Owns the trainer-facing API, identical over in-process Engines and over HTTP:
  generate(prompts | token ids, max_tokens, temperature, top_p, top_k, seed, n, ...)
      -> list[RolloutResult], prompt-major (prompt 0's n samples, then prompt 1's, ...)
  start(...) -> RolloutHandle (the same batch, in the background)
  update_params(params, version)  fleet-wide two-phase update (all engines or none)
  pause(mode) / resume(), release_memory(tags) / resume_memory(tags), weight_versions()
  resume_aborted(results, ...) re-submits aborted samples (prompt + partial output, the
      remaining budget) and merges them: at temperature 0, or with a seed, the merged
      sample equals an uninterrupted one.

A batch is spread over all engines: prompt i goes to engine (offset + i) mod E (its n
samples stay together, sharing the prompt's KV); the offset rotates per batch.
Uses only multiserve's public API (multiserve.Engine / multiserve.types, or HTTP).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plugins.rollout.results import (
    RolloutError,
    RolloutHandle,
    RolloutResult,
    merge_resumed,
    sampling_dict,
)

Prompt = str | Sequence[int]


class RolloutClient:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._offset = 0

    @classmethod
    def from_engines(cls, engines: Sequence[Any]) -> RolloutClient:
        from plugins.rollout.inproc import InProcessBackend

        return cls(InProcessBackend(engines))

    @classmethod
    def from_http(cls, urls: Sequence[str], supervisor_url: str | None = None
                  ) -> RolloutClient:
        from plugins.rollout.http_backend import HttpBackend

        return cls(HttpBackend(urls, supervisor_url))

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- generation --------------------------------------------------------------------
    def start(self, prompts: Sequence[Prompt], max_tokens: int = 128,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
              seed: int | None = None, n: int = 1, stop: Sequence[str] | None = None,
              ignore_eos: bool = False) -> RolloutHandle:
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: give at least one prompt")
        e = self.backend.num_engines
        assign = [(self._offset + i) % e for i in range(len(prompts))]
        self._offset = (self._offset + len(prompts)) % e
        sampling = sampling_dict(max_tokens, temperature, top_p, top_k, seed, n, stop,
                                 ignore_eos)
        return self.backend.start(prompts, sampling, assign)

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 seed: int | None = None, n: int = 1, stop: Sequence[str] | None = None,
                 ignore_eos: bool = False, timeout: float = 600.0) -> list[RolloutResult]:
        return self.start(prompts, max_tokens, temperature, top_p, top_k, seed, n, stop,
                          ignore_eos).result(timeout)

    def resume_aborted(self, results: Sequence[RolloutResult], max_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                       seed: int | None = None, ignore_eos: bool = False,
                       timeout: float = 600.0) -> list[RolloutResult]:
        """Continue every aborted sample (prompt + its tokens, budget max_tokens minus what
        it has); others are returned unchanged. Needs token-id prompts (prompt_ids)."""
        todo = [r for r in results if r.finish_reason == "abort"
                and len(r.token_ids) < max_tokens]
        if not todo:
            return list(results)
        if any(not r.prompt_ids for r in todo):
            raise RolloutError("resume_aborted needs results of token-id prompts")
        handles = [self.start([r.continuation_ids()], max_tokens - len(r.token_ids),
                              temperature, top_p, top_k, seed, 1, None, ignore_eos)
                   for r in todo]
        done = {(r.prompt_index, r.sample_index): merge_resumed(r, h.result(timeout)[0])
                for r, h in zip(todo, handles, strict=True)}
        return [done.get((r.prompt_index, r.sample_index), r) for r in results]

    # ---- fleet control ---------------------------------------------------------------------
    def pause(self, mode: str = "retract") -> Any:
        return self.backend.pause(mode)

    def resume(self) -> Any:
        return self.backend.resume()

    def abort_all(self) -> Any:
        return self.backend.abort_all()

    def update_params(self, params: Any, version: str, abort_running: bool = False) -> Any:
        """Push new weights to every engine (staged everywhere, then published; on any
        staging failure nothing changes and RolloutError names the engine). `params`:
        the params pytree or a flat {HF name: array} dict (a subset updates only those
        tensors), or an HF safetensors directory path."""
        return self.backend.update_params(params, version, abort_running)

    def release_memory(self, tags: Sequence[str] = ("weights", "kv_cache"),
                       mode: str = "retract", preserve_state: bool = False) -> Any:
        return self.backend.release_memory(tuple(tags), mode, preserve_state)

    def resume_memory(self, tags: Sequence[str] = ("weights", "kv_cache")) -> Any:
        return self.backend.resume_memory(tuple(tags))

    def weight_versions(self) -> list[str]:
        return self.backend.weight_versions()
