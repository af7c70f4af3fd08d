"""Req: all per-request (per-sample) state in one place.

Position bookkeeping (the invariants the scheduler and runner rely on):
- `fill_ids` = prompt + output so far (what a re-prefill recomputes).
- `kv_len`: positions [0, kv_len) have their K/V written, or written by a step already
  launched on the device (device order makes an in-flight write as good as done).
- `pending`: tokens sampled by launched steps whose ids the host has not read yet
  (0, 1 or 2 under overlap; a step running K decode steps in one dispatch adds K). While
  decoding: kv_len == len(prompt) + len(output) + pending - 1, i.e. the next decode input
  is the newest token, at position kv_len.
- `pages` cover positions [0, len(pages) * page_size) >= kv_len; the first
  `num_cached_pages` are shared through the prefix cache (ref-counted), the rest are
  owned by this Req alone. A model whose every layer slides (ModelConfig.kv_window)
  reads no K/V further back than its window: the first `window_dropped` pages are no
  longer held (released to the prefix cache, or freed; their entries are 0, the garbage
  page) and the Req holds `held_pages` only (Scheduler `_drop_out_of_window`).
- A token at position P is sampled with the key (seed, index, P): resumed, retracted
  or re-batched requests draw the same tokens.

Ownership: after construction (`Req.samples_of`), only the Scheduler changes a Req
(engine/sched/scheduler.py: admission, launch, retraction, `postprocess` of a step's
results, `finish`); everything else reads. The one exception is the delivery cursor
(`sent`, `prompt_logprobs_sent`), advanced by `next_delta`, which only the core's one
delivery function (`EngineCore._deliver`) calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from multiserve.engine.base.frozen_build import built
from multiserve.engine.base.routed_experts import RoutedExpertsTable
from multiserve.types import (
    FinishReason,
    GenerateRequest,
    OutputDelta,
    RequestStatus,
    RoutedExperts,
    SamplingParams,
    TokenLogprob,
    WeightSegment,
)

OutputSink = Callable[[OutputDelta], None]


@dataclass(eq=False)
class Req:
    rid: str  # the caller's request id (shared by the n samples of one request)
    index: int  # sample index within the request (0..n-1)
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    sink: OutputSink
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    # KV bookkeeping (see module docstring)
    pages: list[int] = field(default_factory=list)
    num_cached_pages: int = 0
    window_dropped: int = 0  # leading pages no longer held (module docstring)
    kv_len: int = 0
    pending: int = 0
    prefill_target: int = 0  # len(fill_ids) when the current prefill was admitted
    cached_tokens: int = 0  # prefix-cache hit of the first admission
    admitted_once: bool = False
    # weight versions: output index where each version began
    weight_segments: list[WeightSegment] = field(default_factory=list)
    # row of this Req in the last launched step's sampled ids (valid while pending > 0)
    last_out_row: int = -1
    num_retractions: int = 0
    # prompt logprobs: entry j is the logprob of prompt token j (entry 0 is None)
    want_prompt_logprobs: bool = False
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    # n > 1: siblings wait until sample 0 has prefilled the shared prompt
    leader: Req | None = None
    # output already handed to the sink: output_ids[:sent] (and their logprobs), and
    # whether the prompt logprobs went out (see next_delta)
    sent: int = 0
    prompt_logprobs_sent: bool = False
    # speculative decoding (engine/spec/): verify steps run, draft tokens accepted
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # the sample's grammar matcher (multiserve/grammar GrammarState) when params.grammar
    # is set: made by Scheduler.add, advanced with every emitted token
    grammar: Any = None
    # why the engine itself ended this sample (e.g. its grammar rejected a token):
    # delivered as the output's `error` unless the finish path gives one
    error: str | None = None
    # the LoRA adapter slot this sample runs with (0: the base model), set at admission
    # (EngineCore.add); such a sample reads and fills only its adapter version's part of
    # the prefix cache (its K/V are the adapter's: Scheduler `_cache_root`)
    lora_slot: int = 0
    lora_name: str | None = None  # the request's adapter (None: the base model)
    lora_optional: bool = False  # an unknown lora_name runs the base model (not refused)
    # the request's prefix-cache namespace (GenerateRequest.cache_salt; None: unkeyed): it
    # matches and fills only cached K/V of its own namespace (Scheduler `_cache_root`)
    cache_salt: str | None = None
    # routing replay (engine/base/routed_experts.py): asked for, from which position; the ids
    # of positions [0, len(routed_rows)) as of the last `keep_routing` (taken before the
    # sample's pages go: at a retraction and at the finish); the finished delta's record
    want_routed_experts: bool = False
    routed_experts_start: int = 0
    routed_read: int = 0  # positions [0, routed_read) of its pages: ids in the table
    routed_rows: Any = None
    routed_experts: RoutedExperts | None = None

    @classmethod
    def samples_of(cls, request: GenerateRequest, seed: int, sink: OutputSink) -> list[Req]:
        """The n Reqs of one (checked) request: sample i draws with (seed, i); samples
        1..n-1 follow sample 0 (`leader`), which prefills the shared prompt first."""
        p = request.sampling
        ids = list(request.input_ids)
        leader = cls(rid=request.rid, index=0, prompt_ids=ids, params=p, seed=seed,
                     sink=sink, stream=request.stream,
                     want_prompt_logprobs=request.return_prompt_logprobs,
                     lora_name=request.lora_name, lora_optional=request.lora_optional,
                     want_routed_experts=request.return_routed_experts,
                     routed_experts_start=request.routed_experts_start_len,
                     cache_salt=request.cache_salt)
        return [leader] + [
            cls(rid=request.rid, index=i, prompt_ids=ids, params=p, seed=seed, sink=sink,
                stream=request.stream, want_prompt_logprobs=request.return_prompt_logprobs,
                leader=leader, lora_name=request.lora_name,
                lora_optional=request.lora_optional,
                want_routed_experts=request.return_routed_experts,
                routed_experts_start=request.routed_experts_start_len,
                cache_salt=request.cache_salt) for i in range(1, p.n)]

    @property
    def key(self) -> tuple[str, int]:
        return (self.rid, self.index)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def held_pages(self) -> list[int]:
        """The pages this Req holds (cached or private): all but the dropped ones."""
        return self.pages[self.window_dropped:]

    @property
    def chain_intact(self) -> bool:
        """Whether the prefix cache may extend this Req's cached pages: nothing dropped,
        or the last cached page (the chain's end, where an insert continues) still held."""
        return self.window_dropped == 0 or self.window_dropped < self.num_cached_pages

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Admitted but its (re-)prefill is not fully launched yet."""
        return self.kv_len < self.prefill_target

    @property
    def num_generated(self) -> int:
        """Output tokens including those sampled on device but not yet read."""
        return len(self.output_ids) + self.pending

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.want_prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_ids)

    def prompt_logprob_targets(self, start: int, end: int) -> range:
        """Prompt indexes j whose logprob comes from this chunk [start, end): the logits
        at position j - 1 score prompt token j; done ones are skipped."""
        if not self.needs_prompt_logprobs:
            return range(0)
        first = max(start + 1, len(self.prompt_logprobs))
        last = min(end, len(self.prompt_ids) - 1)
        return range(first, last + 1)

    def keep_routing(self, table: RoutedExpertsTable | None) -> None:
        """Copy this sample's routing out of `table` before its pages go (a retraction,
        the finish): positions [0, len(fill_ids) - 1) as far as their steps were read
        back (`routed_read`: a prefill chunk still in flight has no ids yet).
        A shorter copy (a sample retracted, then ended part-way into its recompute) never
        replaces a longer one: the ids of a position are the same whoever computes them.
        Once finished: its record, from `routed_experts_start`."""
        if table is None or not self.want_routed_experts:
            return
        end = max(min(len(self.fill_ids) - 1, self.routed_read,
                      len(self.pages) * table.page_size), 0)
        if self.routed_rows is None or end >= len(self.routed_rows):
            self.routed_rows = table.rows(self.pages, end)
        if self.finished:
            rows = self.routed_rows[:max(len(self.fill_ids) - 1, 0)]
            self.routed_experts = table.encode(rows, min(self.routed_experts_start, len(rows)))

    def wants_more(self) -> bool:
        return not self.finished and self.num_generated < self.params.max_new_tokens

    def next_delta(self, weight_version: str, error: str | None = None) -> OutputDelta:
        """What the sink has not seen yet: output_ids[sent:] (output_ids only grow), and
        the prompt logprobs once they are complete. Advances `sent`."""
        start, end = self.sent, len(self.output_ids)
        self.sent = end
        prompt_lps = None
        if self.want_prompt_logprobs and not self.prompt_logprobs_sent and (
                not self.needs_prompt_logprobs or self.finished):
            prompt_lps = tuple(self.prompt_logprobs)
            self.prompt_logprobs_sent = True
        return built(
            OutputDelta,
            rid=self.rid,
            index=self.index,
            start=start,
            new_ids=tuple(self.output_ids[start:end]),
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            new_logprobs=(tuple(self.output_logprobs[start:end])
                          if self.params.wants_logprobs else None),
            prompt_logprobs=prompt_lps,
            weight_segments=tuple(self.weight_segments),
            matched_stop=self.matched_stop,
            error=error if error is not None else self.error,
            spec_verify_ct=self.spec_verify_ct,
            spec_accepted_tokens=self.spec_accepted_tokens,
            routed_experts=self.routed_experts if self.finished else None,
        )
