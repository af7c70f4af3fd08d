"""Pydantic models of the native (sglang-compatible) and control endpoints.

Owns: the /generate request and response, /v1/score request and response (the control
routes' bodies are server/control_bodies.py's).

Invariants: strict JSON parsing; unknown top-level fields ignored (sglang clients and
routers send many that change nothing here), but set features we cannot honour are refused
(`REFUSED_FEATURES`); the `sampling_params` key policy is in
`multiserve/sampling_policy.py`; range checks stay in `SamplingParams`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from multiserve.sampling_policy import to_sampling_params
from multiserve.types import SamplingParams, cache_namespace


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# Top-level /generate keys sglang accepts that would change the result and that we cannot
# honour: refused when set (truthy), never silently ignored.
REFUSED_FEATURES = {
    "image_data": "multimodal input is not supported",
    "video_data": "multimodal input is not supported",
    "audio_data": "multimodal input is not supported",
    "input_embeds": "input_embeds are not supported; give text or input_ids",
    "lora_id": "lora_id is not supported; name the adapter in lora_path",
    "custom_logit_processor": "custom logit processors are not supported",
    "return_hidden_states": "hidden states are not returned by this server",
    "session_params": "sessions are not supported",
    "return_entropy": "token entropies are not returned by this server",
    "return_bytes": "token bytes are not returned by this server",
    "background": "background requests are not supported",
}


def is_set(value: Any) -> bool:
    """Whether a refusable field asks for something: null, false, "" and empty containers
    do not, and neither does a list whose items are all unset (verl sends
    `image_data: [null, null, ...]`, one entry per prompt, for text-only batches)."""
    if isinstance(value, list):
        return any(is_set(v) for v in value)
    return value not in (None, False, "", {})


class GenerateRequestBody(_Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    # the loaded LoRA adapter each prompt runs with, by name (one for all prompts, or one per
    # prompt; null: the base model)
    lora_path: str | list[str | None] | None = None
    lora_id: Any = None
    # SGLang's prefix-cache isolation key, one for every prompt or one per prompt (empty or
    # null: none): types.cache_namespace(None, extra_key)
    extra_key: str | list[str | None] | None = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    # SGLang's routing replay: meta_info.routed_experts, base64 of int32
    # [prompt + output - 1 - routed_experts_start_len, layers, top_k] (types.RoutedExperts)
    return_routed_experts: bool | None = False  # null: not asked (as false)
    routed_experts_start_len: int = Field(default=0, ge=0)
    session_params: Any = None
    return_entropy: Any = None
    return_bytes: Any = None
    background: Any = None
    # Sent by sglang-router (and ignored by sglang's /generate): the model is the one served.
    model: str | None = None

    def refused_feature(self) -> tuple[str, str] | None:
        """(key, why) of the first set feature we cannot honour."""
        for key, why in REFUSED_FEATURES.items():
            if is_set(getattr(self, key)):
                return key, why
        return None

    def cache_keys(self, count: int) -> list[str | None]:
        """The prefix-cache namespace of each of `count` prompts (ValueError: a list of
        another length)."""
        keys = self.extra_key
        if isinstance(keys, list):
            if len(keys) != count:
                raise ValueError(f"extra_key: need one entry per prompt, got {len(keys)} "
                                 f"for {count}")
            return [cache_namespace(None, k) for k in keys]
        return [cache_namespace(None, keys)] * count

    def lora_names(self, count: int) -> list[str | None]:
        """The adapter of each of `count` prompts (ValueError: a list of another
        length)."""
        if isinstance(self.lora_path, list):
            if len(self.lora_path) != count:
                raise ValueError(f"lora_path: need one entry per prompt, got "
                                 f"{len(self.lora_path)} for {count}")
            return list(self.lora_path)
        return [self.lora_path] * count

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

    def sampling(self, raw: dict[str, Any], grammar: Any = None) -> SamplingParams:
        """SamplingParams for one prompt's sampling dict (raises SamplingParamsError);
        `grammar`: its constraint, compiled."""
        return to_sampling_params(
            raw, grammar=grammar, return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
            token_ids_logprob=None if self.token_ids_logprob is None
            else tuple(self.token_ids_logprob))


class GenerateMetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    matched_stop: int | str | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    output_token_ids_logprob: list[list[list[Any]] | None] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    weight_segments: list[dict[str, Any]] | None = None
    # return_routed_experts, on the final object / chunk: base64 of little-endian int32
    # [prompt_tokens + completion_tokens - 1 - routed_experts_start_len, layers, top_k]
    routed_experts: str | None = None


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
