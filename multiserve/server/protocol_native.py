"""Pydantic models of the native (sglang-compatible) and control endpoints.

Owns: the /generate request and response, /v1/score request and response, and the
bodies of /pause_generation and /abort_request; plus the mapping of a native
`sampling_params` dict onto `SamplingParams`.

Invariants: strict JSON parsing, unknown fields ignored (sglang clients send many we
do not use); range checks stay in `SamplingParams`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from multiserve.types import SamplingParams, SamplingParamsError

# sampling_params keys the engine understands (sglang names); others are ignored.
NATIVE_SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p",
                        "min_p", "frequency_penalty", "presence_penalty",
                        "repetition_penalty", "seed", "n", "stop", "stop_token_ids",
                        "ignore_eos", "skip_special_tokens")
DEFAULT_MAX_NEW_TOKENS = 128


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class GenerateRequestBody(_Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False

    def prompts(self) -> tuple[list[str] | list[list[int]], bool]:
        """(prompts, is_batch): exactly one of text / input_ids must be given."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], False
            return list(self.text), True
        ids = self.input_ids or []
        if ids and isinstance(ids[0], list):
            return [list(x) for x in ids], True  # type: ignore[arg-type]
        return [list(ids)], False  # type: ignore[arg-type]


def native_sampling(body: GenerateRequestBody) -> SamplingParams:
    """The engine's SamplingParams for a /generate body (max_new_tokens defaults to 128;
    its fit in the context is checked later). Raises SamplingParamsError naming the key."""
    raw = dict(body.sampling_params or {})
    given = {k: raw[k] for k in NATIVE_SAMPLING_KEYS if k in raw and raw[k] is not None}
    max_new = given.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if "stop" in given and not isinstance(given["stop"], (str, list)):
        raise SamplingParamsError("stop", "must be a string or a list of strings")
    if "stop_token_ids" in given and not isinstance(given["stop_token_ids"], list):
        raise SamplingParamsError("stop_token_ids", "must be a list of integers")
    for key in ("ignore_eos", "skip_special_tokens"):
        if key in given and not isinstance(given[key], bool):
            raise SamplingParamsError(key, "must be a boolean")
    return SamplingParams(
        max_new_tokens=max_new,
        return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
        token_ids_logprob=None if body.token_ids_logprob is None
        else tuple(body.token_ids_logprob), **given)


class GenerateMetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float | None = None
    matched_stop: int | str | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    output_token_ids_logprob: list[list[list[Any]] | None] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    weight_segments: list[dict[str, Any]] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    index: int = 0
    meta_info: GenerateMetaInfo


class ScoreRequest(_Request):
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class ScoreResponse(BaseModel):
    scores: list[list[float]]
    model: str
    object: Literal["scoring"] = "scoring"
    usage: dict[str, int] = Field(default_factory=dict)


class PauseBody(_Request):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortBody(_Request):
    rid: str | None = None
    abort_all: bool = False
