"""Jax-free records shared by the engine, the HTTP side and the fleet.

Owns: `SamplingParams` (validated on construction), the request and output records,
control results, the `EngineClient` protocol the HTTP server talks to (its control
operations are control_ops.py's), and the control vocabulary (pause modes and reasons,
memory tags, the "asleep" health status).

Invariants:
- Nothing here imports jax, numpy-on-device code or anything under `engine/`/`model/`:
  the server package imports this module and must stay device-agnostic.
- Every record is immutable (frozen dataclasses) except where noted; outputs are
  snapshots, never views of live engine state. (A SamplingParams keeps one value derived
  from its fields, `sampler_fields`, computed on first use.)
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, get_args, runtime_checkable

if TYPE_CHECKING:
    from multiserve.grammar.grammar import Grammar

FinishReason = Literal["stop", "length", "abort"]

# The control vocabulary: each concept is spelled once, here, and imported by the engine,
# the HTTP bodies and the fleet. Every tuple is derived from its Literal (never restated),
# so the runtime checks and the pydantic fields cannot drift apart.

# What a pause does to running requests (engine/core.py). Each route keeps its own default
# (sglang's: /pause_generation "abort", /release_memory_occupation "retract"; vLLM's /pause
# "abort"). sglang's names: abort, retract, in_place; vLLM's: abort, keep (= in_place,
# `canonical_pause_mode`), wait (admission closes, the requests live at the pause finish,
# then the pause holds: a pause_generation mode only, not a hold's: HOLD_MODES).
PauseMode = Literal["abort", "retract", "in_place", "keep", "wait"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
HOLD_MODES: tuple[PauseMode, ...] = tuple(m for m in PAUSE_MODES if m != "wait")
# Why an engine is paused (it steps only while it has none): the user's pause_generation,
# a staged weight update waiting for publish/discard, device memory released. Each is
# added and removed by its own owner only (engine/core.py).
PauseReason = Literal["user", "weights_staged", "memory_released"]
PAUSE_REASONS: tuple[PauseReason, ...] = get_args(PauseReason)
# Device memory a release frees and a resume restores (sglang's tag names), in resume
# order: weights before K/V (engine/rl/memory.py). sglang's "cuda_graph" is not one: the
# HTTP side accepts it as a no-op (server/control_bodies.py NOOP_TAGS).
MemoryTag = Literal["weights", "kv_cache"]
MEMORY_TAGS: tuple[MemoryTag, ...] = get_args(MemoryTag)
# /health's status (and the prefix of the health reason) of a healthy engine whose memory
# is released: built by `asleep_reason` (Engine.health), recognised by `is_asleep` (the app).
ASLEEP = "asleep"


def check_pause_mode(mode: str, allowed: tuple[PauseMode, ...] = PAUSE_MODES) -> None:
    """ValueError unless `mode` is one of `allowed` (the Python API's check; the HTTP
    bodies check it through their `PauseMode` field, the engine's records again)."""
    if mode not in allowed:
        raise ValueError(f"mode: must be one of {allowed}, got {mode!r}")


def canonical_pause_mode(mode: PauseMode) -> PauseMode:
    """One spelling per behaviour: vLLM's "keep" is "in_place"."""
    return "in_place" if mode == "keep" else mode


def asleep_reason(released: Iterable[str]) -> str:
    """The health reason of a healthy engine with these memory tags released."""
    return f"{ASLEEP}: memory released ({', '.join(sorted(released))})"


def is_asleep(reason: str) -> bool:
    """Whether a healthy engine's reason says its memory is released (`asleep_reason`)."""
    return reason.startswith(ASLEEP)

# Upper bounds the jitted sampler is compiled for (fixed shapes: no recompiles).
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 32
MAX_STOP_TOKEN_IDS = 64


class SamplerFields(NamedTuple):
    """What a `SamplingParams` puts in every sampler row it governs, the same at every step
    of every sample of its request (engine/step_inputs/sampling_batch.py stores them), with greedy
    folded in: a greedy row has temperature 0, top_k 0, top_p 1 and min_p 0 (no filter)."""

    # temperature, top_p, min_p, frequency / presence / repetition penalty
    floats: tuple[float, float, float, float, float, float]
    top_k: int  # 0: off; the sampler also turns off a top_k >= the vocabulary
    top_logprobs_num: int
    has_penalty: bool
    wants_logprobs: bool


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field_name, message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction (ValueError names the field).

    `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` is greedy.
    `seed=None` lets the engine pick one at submission, so every request is
    reproducible from its own record. Draws are keyed by (seed, sample index, position).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # sglang's no_stop_trim: the text keeps the matched stop string / stop token. Read by
    # the side that detokenizes (the HTTP server); the engine stops the same either way.
    no_stop_trim: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    # A compiled decoding constraint (multiserve/grammar): every sampled token is one the
    # grammar allows; the sample ends ("stop") once the grammar is complete. Logprobs keep
    # describing the model's raw distribution, not the constrained one.
    grammar: Grammar | None = None
    # The last `grammar_resumed` prompt tokens were generated under `grammar` already (a
    # request resubmitted with its partial output): the matcher replays them first.
    grammar_resumed: int = 0

    def __post_init__(self) -> None:
        # Normalise list inputs into tuples (frozen: use object.__setattr__ once).
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if value is None:
                value = ()
            object.__setattr__(self, name, tuple(value))
        if self.token_ids_logprob is not None:
            object.__setattr__(self, "token_ids_logprob", tuple(self.token_ids_logprob))
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
               "max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        _check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
               "min_new_tokens", f"must be an integer >= 0, got {self.min_new_tokens!r}")
        _check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}")
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        _check(_is_int(self.top_k), "top_k", f"must be an integer, got {self.top_k!r}")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0,
                   name, f"must be a number in [-2, 2], got {value!r}")
        _check(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               "seed", f"must be an integer in [0, 2**63) or null, got {self.seed!r}")
        _check(_is_int(self.n) and 1 <= self.n <= 64, "n",
               f"must be an integer in [1, 64], got {self.n!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        _check(_is_int(self.top_logprobs_num) and 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS,
               "top_logprobs_num", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(_is_int(self.grammar_resumed) and self.grammar_resumed >= 0,
               "grammar_resumed", "must be an integer >= 0")
        if self.token_ids_logprob is not None:
            _check(all(_is_int(t) and t >= 0 for t in self.token_ids_logprob),
                   "token_ids_logprob", "must be non-negative integers")
            _check(len(self.token_ids_logprob) <= MAX_TOKEN_IDS_LOGPROB, "token_ids_logprob",
                   f"at most {MAX_TOKEN_IDS_LOGPROB} ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        """A frequency, presence or repetition penalty applies (the sampler then reads
        the output so far)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def wants_logprobs(self) -> bool:
        return (self.return_logprob or self.top_logprobs_num > 0
                or self.token_ids_logprob is not None)

    @functools.cached_property
    def sampler_fields(self) -> SamplerFields:
        """This params' part of a sampler row. Computed on first use and kept in the
        instance: the params are frozen, so nothing invalidates it (a changed request
        is a new SamplingParams, `with_updates`)."""
        greedy = self.is_greedy
        return SamplerFields(
            floats=(0.0 if greedy else self.temperature, 1.0 if greedy else self.top_p,
                    0.0 if greedy else self.min_p, self.frequency_penalty,
                    self.presence_penalty, self.repetition_penalty),
            top_k=0 if greedy or self.top_k <= 0 else self.top_k,
            top_logprobs_num=self.top_logprobs_num,
            has_penalty=self.has_penalty,
            wants_logprobs=self.wants_logprobs)

    def with_updates(self, **changes: Any) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob record for one generated (or prompt) position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    selected: tuple[tuple[int, float], ...] = ()  # logprobs of token_ids_logprob


@dataclass(frozen=True)
class WeightSegment:
    """Output tokens from `start` (index into output ids) on came from `weight_version`."""

    start: int
    weight_version: str


@dataclass(frozen=True)
class RoutedExperts:
    """Routing replay (SGLang's `return_routed_experts`): the top-k expert ids a MoE model
    chose for the positions [start, start + rows) of a sample's sequence (prompt + output),
    every layer, as SGLang sends them: `data` is the little-endian int32 bytes of an array
    [rows, num_layers, top_k] (C order; ids in the router's rank order; -1 in the slots of a
    dense layer). The sequence's last token has no row (no forward ran on it yet), so a
    finished sample of P prompt and O output tokens covers [start, P + O - 1)."""

    start: int
    num_layers: int
    top_k: int
    data: bytes

    @property
    def rows(self) -> int:
        return len(self.data) // (4 * self.num_layers * self.top_k)

    def ids(self) -> list[list[list[int]]]:
        """The ids as nested lists [rows][num_layers][top_k]."""
        flat = struct.unpack(f"<{len(self.data) // 4}i", self.data)
        k, per_row = self.top_k, self.num_layers * self.top_k
        return [[list(flat[r * per_row + j * k:r * per_row + (j + 1) * k])
                 for j in range(self.num_layers)] for r in range(self.rows)]


@dataclass(frozen=True)
class GenerateRequest:
    """What the HTTP side (or a Python caller) submits to an engine.

    `input_ids` is always given (the tokenizer side tokenizes). `rid` is unique per
    engine; with `n > 1` the engine runs n samples whose outputs carry `index`.
    `return_routed_experts`: each sample's final output carries its `RoutedExperts` from
    position `routed_experts_start_len` (in [0, len(input_ids)]; SGLang's field: a client
    continuing a sequence asks only for the rows it lacks) to the end.
    """

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool = False
    return_prompt_logprobs: bool = False
    # the LoRA adapter the request runs with (a loaded adapter's name; None: the base model);
    # `lora_optional`: a name that is no loaded adapter runs the base model (the OpenAI
    # `model` field) instead of being refused
    lora_name: str | None = None
    lora_optional: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # prefix-cache isolation (vLLM's cache_salt, SGLang's extra_key: `cache_namespace`):
    # the request matches and fills only cached K/V of requests with the same key (None:
    # the unkeyed namespace). Never changes an output: only what is recomputed.
    cache_salt: str | None = None


def cache_namespace(*keys: str | None) -> str | None:
    """The prefix-cache key of a request from its clients' fields (vLLM's cache_salt,
    SGLang's extra_key, in that order): None when none is set; otherwise each part length-
    prefixed, so that two different tuples of keys never give one namespace."""
    if not any(keys):
        return None
    return "".join(f"{len(k or '')}:{k or ''}" for k in keys)


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one sample of a request: everything so far (the consumer-side view,
    assembled from the engine's `OutputDelta`s by `engine.streams.OutputAssembler`).

    Streaming yields these repeatedly with growing `output_ids`; the last one has
    `finished=True`. `text` is filled by the side that owns a tokenizer.
    """

    rid: str
    index: int
    output_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    weight_segments: tuple[WeightSegment, ...] = ()
    matched_stop: int | str | None = None
    error: str | None = None
    # speculative decoding: verify steps of this sample, draft tokens they accepted
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # return_routed_experts: set on the finished output (aborted ones included)
    routed_experts: RoutedExperts | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class OutputDelta:
    """What the engine emits for one sample: the tokens it produced since its previous
    delta (with their logprobs), and, on the last one, how it finished. The engine sends
    nothing cumulative; `engine.streams.OutputAssembler` rebuilds the `RequestOutput`
    view on the consumer's side.

    Invariants: a sample's deltas arrive in order, `start` is the number of output tokens
    sent before this delta (so deltas tile the output exactly), exactly one has
    `finished=True` and it is the last. `prompt_logprobs` is set on the delta where they
    became available (asked for with return_prompt_logprobs), else None.
    `weight_segments` is the sample's whole (short) list, as of this delta."""

    rid: str
    index: int
    start: int
    new_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    new_logprobs: tuple[TokenLogprob, ...] | None = None  # None: logprobs not asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    weight_segments: tuple[WeightSegment, ...] = ()
    matched_stop: int | str | None = None
    error: str | None = None
    spec_verify_ct: int = 0  # as of this delta (speculative decoding's verify steps)
    spec_accepted_tokens: int = 0  # draft tokens those accepted
    # return_routed_experts: on the finished delta only (every row at once, as SGLang)
    routed_experts: RoutedExperts | None = None


@dataclass(frozen=True)
class ControlResult:
    """Outcome of a control call (pause, continue, abort, flush, ...)."""

    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.ok, "message": self.message, **self.details}


class InvalidRequest(ValueError):
    """The engine refused a request as given (the one place that checks a request against
    the served model: prompt, token ids, context length, rid). `param` names the field in
    the engine's terms (input_ids, max_new_tokens, rid); an HTTP layer maps it to its own
    field name and answers 400 with `code`."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineUnavailable(RuntimeError):
    """The engine cannot take work (unhealthy or shut down); the message says why."""


class EngineOverloaded(RuntimeError):
    """The engine refused new work because its waiting queue is full (see
    engine/sched/admission.py). The HTTP side answers `status` (429 or 503) with `reason` as
    the error code and a `Retry-After: retry_after` header (seconds)."""

    def __init__(self, message: str, *, status: int = 503, reason: str = "overloaded",
                 retry_after: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


@runtime_checkable
class EngineClient(Protocol):
    """What one HTTP app (and the supervisor) needs from one engine. Implemented by
    `multiserve.Engine` itself and by the fleet's worker handle. `acontrol` and `stream`
    are called from the server's event loop (any thread) and never block that loop."""

    model_name: str
    context_len: int

    def stream(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit and yield snapshots until every sample finished (one final output
        per sample, `finished=True`). Closing/cancelling the iterator early aborts the
        request in the engine and frees its KV."""
        ...

    async def open_streams(self, requests: Sequence[GenerateRequest]
                           ) -> list[AsyncIterator[OutputDelta]]:
        """Admit every request ATOMICALLY (one command to the engine thread: all are
        queued before its next step, or none when one is refused, which raises), then one
        iterator per request over its `OutputDelta`s (what the engine emits; the last per
        sample has `finished=True`); `aclose()` on one aborts its request."""
        ...

    async def acontrol(self, name: str, /, **args: Any) -> Any:
        """Run control operation `name` of multiserve/control_ops.py (pause_generation,
        flush_cache, release_memory_occupation, ...) with its arguments: a ControlResult
        (get_internal_state: a dict). ValueError for a bad argument, EngineUnavailable
        when the engine cannot take it."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, reason). Unhealthy engines answer 503 with the reason."""
        ...
