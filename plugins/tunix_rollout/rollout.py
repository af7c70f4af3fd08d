"""MultiserveRollout: a Tunix `BaseRollout` that runs a multiserve Engine in the trainer's process.

Give it to Tunix as `ClusterConfig(rollout_engine=functools.partial(MultiserveRollout,
engine_config=EngineConfig(model_path=..., ...)), ...)`; Tunix constructs it with
(rollout_actor, tokenizer, mesh, rollout_config). The engine serves the model of
`engine_config.model_path` (its config.json and tokenizer) on the devices of Tunix's
rollout mesh, and takes the actor's weights at once, then at every `sync_weights`.

- generate: Tunix's RolloutConfig is honoured: temperature (0: greedy), top_p, top_k,
  seed (row i of call c samples with seed + c * 1_000_003 + i, so the repeated prompts of
  a GRPO group draw differently and a run is reproducible), max_tokens_to_generate,
  max_prompt_length (prompts keep their last tokens, left padded with pad_id),
  eos_tokens (else the tokenizer's EOS), return_logprobs (the sampled tokens' logprobs
  under the raw distribution, temperature 1, as sglang's).
- update_params: Tunix's params state (jax.Arrays on the trainer's mesh) -> HF names
  (param_names.py: reshapes/transposes on the trainer's devices) -> the engine's
  `update_weights_from_arrays` (device-to-device resharding onto the engine's shardings,
  no host copy, no cast), between pause_generation and continue_generation; each sync is
  a new weight version "tunix-<n>".
- get_per_token_logps: a scoring pass on the engine (prompt logprobs of prompt +
  completion), the rollout policy's logprobs at temperature 1.

Invariants: uses only multiserve's public API; the engine never aliases the trainer's
buffers (the update copies), so the trainer may donate or delete them after a sync.
Not supported: LoRA-only syncs (nnx.LoRAParam filters), offload_to_cpu (model() is None:
the weights live in the engine).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl.rollout.base_rollout import BaseRollout, RolloutConfig, RolloutOutput

from multiserve import Engine, OutputAssembler
from multiserve.config import EngineConfig
from multiserve.types import GenerateRequest, RequestOutput, SamplingParams
from plugins.tunix_rollout.param_names import hf_named_arrays

SEED_STRIDE = 1_000_003  # between two generate calls' seeds (more rows than any batch)


class MultiserveRollout(BaseRollout):
    """See the module docstring."""

    def __init__(self, rollout_actor: Any = None, tokenizer: Any = None,
                 mesh: jax.sharding.Mesh | None = None,
                 rollout_config: RolloutConfig | None = None, *,
                 engine_config: EngineConfig, pause_mode: str = "retract") -> None:
        if tokenizer is None:
            raise ValueError("MultiserveRollout needs Tunix's tokenizer")
        self._tokenizer = TokenizerAdapter(tokenizer)
        if mesh is not None:
            devices = jax.devices()
            engine_config = dataclasses.replace(engine_config, device_indexes=tuple(
                devices.index(d) for d in mesh.devices.flat))
        self.mesh = mesh
        self._pause_mode = pause_mode
        self._engine = Engine(engine_config)
        self._syncs = 0
        self._calls = itertools.count()
        if rollout_actor is not None:
            self.update_params(nnx.state(rollout_actor, nnx.Param))

    @property
    def engine(self) -> Engine:
        return self._engine

    def shutdown(self) -> None:
        self._engine.shutdown()

    # ---- BaseRollout ------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: RolloutConfig,
                 **kwargs: Any) -> RolloutOutput:
        call = next(self._calls)
        width = rollout_config.max_prompt_length
        ids = [self._tokenizer.encode(_text(p))[-width:] for p in prompts]
        eos = (tuple(rollout_config.eos_tokens) if rollout_config.eos_tokens
               else (self.eos_id(),))
        base = None if rollout_config.seed is None else int(np.asarray(rollout_config.seed))
        params = [self._sampling(rollout_config, eos, None if base is None else
                                 base + call * SEED_STRIDE + i) for i in range(len(ids))]
        outs = self._run([GenerateRequest(rid=self._engine.new_rid(), input_ids=tuple(p),
                                          sampling=sp) for p, sp in zip(ids, params, strict=True)])
        tokens = [np.asarray(o.output_ids, np.int32) for o in outs]
        padded = np.full((len(ids), width), self.pad_id(), np.int32)
        for row, p in zip(padded, ids, strict=True):
            row[width - len(p):] = p
        logprobs = ([np.asarray([lp.logprob for lp in o.logprobs or ()], np.float32)
                     for o in outs] if rollout_config.return_logprobs else None)
        return RolloutOutput(text=[self._tokenizer.decode(t.tolist()) for t in tokens],
                             logits=None, tokens=tokens, left_padded_prompt_tokens=padded,
                             logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: jax.Array,
                            completion_tokens: jax.Array) -> jax.Array:
        """[B, completion_len]: each completion token's logprob given what precedes it
        (0 after the completion's first pad)."""
        pad = self.pad_id()
        prompts = np.asarray(prompt_tokens)
        completions = np.asarray(completion_tokens)
        out = np.zeros(completions.shape, np.float32)
        rows = []
        for p, c in zip(prompts, completions, strict=True):
            start = int(np.argmax(p != pad)) if (p != pad).any() else len(p)
            end = int(np.argmax(c == pad)) if (c == pad).any() else len(c)
            rows.append((p[start:].tolist(), c[:end].tolist()))
        for i, lp in enumerate(self.score([p for p, _ in rows], [c for _, c in rows])):
            out[i, :len(lp)] = lp
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        if filter_types is not None and any(t is nnx.LoRAParam for t in filter_types):
            raise NotImplementedError("MultiserveRollout syncs whole params, not LoRA params")
        named = hf_named_arrays(params)
        version = f"tunix-{self._syncs}"
        paused = self._engine.pause_generation(self._pause_mode)
        if not paused.ok:
            raise RuntimeError(f"pause_generation: {paused.message}")
        try:
            res = self._engine.update_weights_from_arrays(named, version)
        finally:
            self._engine.continue_generation()
        if not res.ok:
            raise RuntimeError(f"weight sync {version}: {res.message}")
        self._syncs += 1

    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self) -> None:
        """None: the rollout's weights live in the engine (so Tunix syncs them)."""
        return None

    # ---- scoring ------------------------------------------------------------------------
    def score(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
              ) -> list[np.ndarray]:
        """Each completion's per-token logprobs given its prompt, from one prefill of
        prompt + completion on the engine (its prompt logprobs)."""
        reqs = [GenerateRequest(rid=self._engine.new_rid(), input_ids=tuple(p) + tuple(c),
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=0),
                                return_prompt_logprobs=True)
                for p, c in zip(prompts, completions, strict=True)]
        outs = self._run(reqs)
        return [np.asarray([lp.logprob for lp in o.prompt_logprobs[len(p):]], np.float32)
                for o, p in zip(outs, prompts, strict=True)]

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _sampling(cfg: RolloutConfig, eos: tuple[int, ...], seed: int | None
                  ) -> SamplingParams:
        return SamplingParams(
            temperature=float(cfg.temperature), top_p=1.0 if cfg.top_p is None else
            float(cfg.top_p), top_k=-1 if cfg.top_k is None else int(cfg.top_k), seed=seed,
            max_new_tokens=int(cfg.max_tokens_to_generate), stop_token_ids=eos,
            return_logprob=bool(cfg.return_logprobs))

    def _run(self, requests: Sequence[GenerateRequest]) -> list[RequestOutput]:
        """Submit all atomically; each one's final output, in order."""
        queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in requests]
        self._engine.submit_many(requests, [q.put for q in queues])
        outs = []
        for q in queues:
            assemble = OutputAssembler()
            while not (out := assemble(q.get())).finished:
                pass
            if out.error:
                raise RuntimeError(f"request {out.rid}: {out.error}")
            outs.append(out)
        return outs


def _text(prompt: Any) -> str:
    """A prompt as Tunix hands it over: str, or numpy's str / bytes (its batches are arrays)."""
    return prompt.decode() if isinstance(prompt, bytes) else str(prompt)
