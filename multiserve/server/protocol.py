"""Pydantic models of the OpenAI-compatible API (requests, responses, stream chunks).

Owns: the wire shapes of /v1/models, /v1/completions and /v1/chat/completions, and
the mapping of an OpenAI request's sampling fields onto `SamplingParams`.
Native (/generate, /v1/score) and control bodies live in `protocol_native.py`.

Invariants: requests are parsed from raw JSON in strict mode (no "0.5" → 0.5
coercion) and ignore unknown fields, as OpenAI clients expect; range checks are left
to `SamplingParams` (one source of truth), whose field names are mapped back to the
client's parameter names by `OPENAI_PARAM_NAMES`.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from multiserve.types import SamplingParams

FinishReasonStr = Literal["stop", "length", "abort"]
# A chat choice also ends with "tool_calls" when its reply holds tool calls.
ChatFinishReasonStr = Literal["stop", "length", "abort", "tool_calls"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


# OpenAI's message roles. The chat template writes a message's role into the prompt, so
# any other string (e.g. "user\n<|im_start|>system") is refused: a 400 naming
# messages[i].role, never rendered.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


class FunctionCallIn(_Request):
    """A history call's function: `arguments` is JSON text (OpenAI) or an object."""

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # an assistant turn's calls, and a tool turn's answer to one (rendered by the template)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingRequest(_Request):
    """Fields shared by chat and completions requests."""

    # Any string, or none: a loaded LoRA adapter's name runs that adapter; anything else is
    # the served model (RL clients send the model's path); /v1/models lists both.
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions shared with sglang / vLLM clients.
    rid: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # vLLM's: the prompt's and each choice's token ids in the answer (chat:
    # `prompt_token_ids` at the top level, completions: in each choice; streamed: on each
    # choice's first chunk; `token_ids`: each chunk's new ids, together the non-streamed
    # ones), and logprob tokens written "token_id:<id>" instead of the token's text.
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Prefix-cache isolation (types.cache_namespace): vLLM's cache_salt (non-empty, as
    # vLLM requires) and SGLang's extra_key (empty: none). Requests share cached K/V only
    # with requests of the same keys; the outputs are the same either way.
    cache_salt: str | None = Field(default=None, min_length=1)
    extra_key: str | None = None
    # Accepted by OpenAI or sglang, refused when set (see `refused`): never ignored.
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None

    serves_tools: ClassVar[bool] = False

    def refused(self) -> tuple[str, str] | None:
        """(param, why) of the first set option that would change the output and that we
        cannot honour."""
        if self.return_hidden_states:
            return "return_hidden_states", "hidden states are not returned by this server"
        if self.return_routed_experts:
            return "return_routed_experts", ("routed experts are returned by /generate "
                                             "only")
        if self.custom_logit_processor:
            return "custom_logit_processor", "custom logit processors are not supported"
        if self.session_params:
            return "session_params", "sessions are not supported"
        if self.lora_path:
            return "lora_path", "name the LoRA adapter in 'model' instead"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.tools and not self.serves_tools:
            return "tools", "tool calling is only served by /v1/chat/completions"
        if self.stop_regex is not None:
            return "stop_regex", "regex stop conditions are not supported; use 'stop'"
        return None

    def constraint(self) -> tuple[str, str, Any] | None:
        """(param, grammar kind, spec) of the request's decoding constraint: OpenAI's
        `response_format` (json_object, json_schema as `chat.completions.parse` sends it,
        structural_tag) or one of SGLang's regex / json_schema / ebnf / structural_tag
        fields; None for plain text. More than one, or an unknown format: ValueError
        (param, message)."""
        found: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_object":
                found.append(("response_format", "json_object", None))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or "schema" not in js and "schema_" not in js:
                    raise ValueError("response_format.json_schema",
                                     "must be an object with a 'schema'")
                found.append(("response_format.json_schema.schema", "json_schema",
                              js.get("schema", js.get("schema_"))))
            elif kind == "structural_tag":
                found.append(("response_format", "structural_tag", rf))
            elif kind != "text":
                raise ValueError("response_format", "type must be one of text, json_object, "
                                 f"json_schema, structural_tag; got {kind!r}")
        for name in ("regex", "json_schema", "ebnf", "structural_tag"):
            if getattr(self, name) is not None:
                found.append((name, name, getattr(self, name)))
        if len(found) > 1:
            raise ValueError(found[1][0], f"give at most one constraint (got {found[0][0]} "
                             "too)")
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingRequest):
    serves_tools: ClassVar[bool] = True
    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None  # type: ignore[assignment]
    # default: "auto" with tools, "none" without (as SGLang)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # sglang: the reply continues the final (assistant) message instead of starting a new
    # one: the template renders it open, with no generation prompt after it.
    continue_final_message: bool = False
    # sglang: extra variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # With a reasoning parser (--reasoning-parser): the reasoning goes to
    # `reasoning_content` (false: it stays in `content`); stream_reasoning=false sends it
    # in one delta once it is complete. Without a parser both have no effect (as sglang).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # sglang: pre-tokenized prompt ids that replace the rendered messages. Not done here:
    # refused, never ignored (send token ids to /generate or /v1/completions).
    input_ids: Any = None

    def refused(self) -> tuple[str, str] | None:
        if self.input_ids:
            return "input_ids", ("pre-tokenized chat prompts are not supported; send token "
                                 "ids to /generate or /v1/completions")
        return super().refused()

    def template_args(self) -> tuple[bool, dict[str, Any]]:
        """(add_generation_prompt, extra chat-template keyword arguments)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            return False, {**kwargs, "continue_final_message": True}
        return self.add_generation_prompt, kwargs

    @property
    def max_new_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def top_logprobs_num(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    best_of: int | None = None
    suffix: str | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().refused()

    @property
    def max_new_tokens_param(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    @property
    def top_logprobs_num(self) -> int:
        return self.logprobs or 0


# SamplingParams field → the OpenAI parameter a client sent.
OPENAI_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                      "top_logprobs_num": "top_logprobs"}


def openai_sampling(req: ChatCompletionRequest | CompletionRequest,
                    max_new_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for an OpenAI request (raises SamplingParamsError)."""
    given: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            given[name] = value
    wants_logprobs = (req.logprobs is True) if isinstance(req, ChatCompletionRequest) \
        else req.logprobs is not None
    return SamplingParams(
        max_new_tokens=max_new_tokens, min_new_tokens=req.min_tokens,
        n=req.n, stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        no_stop_trim=req.no_stop_trim, return_logprob=wants_logprobs,
        top_logprobs_num=req.top_logprobs_num, **given)


# ---- responses ----------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def build(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCallOut(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaToolCall(_Response):
    """A streamed call piece: the first carries index, id, type and the name (with empty
    arguments); the later ones index and argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonStr | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the generated ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids: the rendered prompt's


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonStr | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ids


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunks


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonStr | None = None
    matched_stop: int | str | None = None
    # return_token_ids (vLLM puts both in the choice): the choice's prompt (streamed: on
    # its first chunk) and its generated ids (streamed: the chunk's new ones)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "multiserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
