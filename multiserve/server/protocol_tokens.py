"""Pydantic models of vLLM's token-in / token-out endpoint, /inference/v1/generate.

Owns: the request ({token_ids, sampling_params, model, stream, ...}), its vLLM-named
sampling parameters and their mapping onto `SamplingParams`, and the answer
({request_id, choices: [{index, token_ids, logprobs, finish_reason}]}) and stream chunk.

Invariants: strict JSON parsing; unknown top-level fields are ignored (as on the OpenAI
endpoints) but unknown `sampling_params` keys are refused (400 naming the key), and so is
any set option we cannot honour (`refused`); range checks stay in `SamplingParams`, whose
field names `PARAM_NAMES` maps back to the client's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from multiserve.server.protocol import ChatLogprobs, FinishReasonStr, StreamOptions, UsageInfo
from multiserve.types import SamplingParams

# SamplingParams field -> the parameter the client sent.
PARAM_NAMES = {"max_new_tokens": "sampling_params.max_tokens",
               "min_new_tokens": "sampling_params.min_tokens",
               "top_logprobs_num": "sampling_params.logprobs",
               **{name: f"sampling_params.{name}" for name in (
                   "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "n", "stop",
                   "stop_token_ids")}}

# vLLM sampling options that would change the output and are not done here: refused when
# set (best_of too, unless it equals n).
REFUSED_OPTIONS = ("prompt_logprobs", "logit_bias", "bad_words", "allowed_token_ids",
                   "structured_outputs", "guided_decoding", "logits_processors",
                   "truncate_prompt_tokens")


class TokensSamplingParams(BaseModel):
    """vLLM's SamplingParams as JSON. `detokenize`, `skip_special_tokens`,
    `spaces_between_special_tokens` and `include_stop_str_in_output` shape text, which this
    endpoint does not return: accepted, no effect on the ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: no top-k filter (vLLM's -1 and 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's logprob and this many top ones
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # REFUSED_OPTIONS and best_of
    prompt_logprobs: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    best_of: Any = None

    def refused(self) -> str | None:
        """The first set option that is not supported, by its key."""
        for key in REFUSED_OPTIONS:
            if getattr(self, key) not in (None, [], {}):
                return key
        if self.best_of not in (None, self.n):
            return "best_of"
        return None

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises SamplingParamsError)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, n=self.n, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            return_logprob=self.logprobs is not None, top_logprobs_num=self.logprobs or 0)


class TokensGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    token_ids: list[int]
    sampling_params: TokensSamplingParams = Field(default_factory=TokensSamplingParams)
    request_id: str | None = None
    model: str | None = None  # any: one model per server, as the OpenAI endpoints
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # prefix-cache isolation (non-empty, as vLLM requires): types.cache_namespace
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0
    kv_transfer_params: Any = None
    features: Any = None

    def refused(self) -> tuple[str, str] | None:
        """(param, why) of the first set option this server cannot honour."""
        if self.priority != 0:
            return "priority", "priority scheduling is not supported (give 0)"
        if self.kv_transfer_params:
            return "kv_transfer_params", "disaggregated KV transfer is not supported"
        if self.features:
            return "features", "multimodal features are not supported"
        key = self.sampling_params.refused()
        if key is not None:
            return f"sampling_params.{key}", f"{key} is not supported on this endpoint"
        return None


class TokensChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    token_ids: list[int] | None = None
    logprobs: ChatLogprobs | None = None  # tokens named "token_id:<id>", as vLLM
    finish_reason: FinishReasonStr | None = None


class TokensGenerateResponse(BaseModel):
    """The whole answer, or (streamed) one chunk: each choice's new ids, the final chunk
    of a choice with its finish_reason, then `usage` alone if stream_options asked."""

    model_config = ConfigDict(extra="allow")

    request_id: str
    choices: list[TokensChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[Any] | None = None
