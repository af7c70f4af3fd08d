"""The OpenAPI description of one engine's app: every route's body and answers.

Owns `document_engine_app(app)`: the table of (method, path) -> the pydantic model the
handler parses, and what it answers (openapi_docs.py does the patching). Also refines
`/generate`'s free-form `sampling_params` into the keys the engine reads, with their
types, so a schema fuzzer exercises them.

Invariants: documentation only; the control routes' entries are derived from the table of
operations (control_routes.py, control_bodies.py), the RL ones appearing once
`add_rl_routes` added them (the document is built at first request).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from multiserve import sampling_policy as S
from multiserve.server import protocol as P
from multiserve.server import parse_routes as PR
from multiserve.server import protocol_native as N
from multiserve.server import protocol_tokens as T
from multiserve.server import weight_transfer as WT
from multiserve.server.control_bodies import ControlBody, body_for, query_parameters
from multiserve.server.control_routes import routed_ops
from multiserve.server.openapi_docs import Answer, ControlAnswer, Key, document
from multiserve.server.vllm_pause import PAUSE_PARAMETERS
from multiserve.types import MAX_TOP_LOGPROBS, MEMORY_TAGS, PAUSE_REASONS

GEN_ERRORS = ("400", "401", "404", "429", "503")
INT, NUM, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
NULL = {"type": "null"}
# sglang's sampling_params keys (multiserve/sampling_policy.py): honoured ones with their
# types, no-op ones, and refused ones (null only: a value is refused with a 400 naming the key).
# Any other key is refused too, hence additionalProperties false.
SAMPLING_PARAMS_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "description": "sglang sampling parameters; null means the default; unknown keys and "
                   "features this server cannot honour are refused (400 naming the key)",
    "properties": {
        "max_new_tokens": INT, "min_new_tokens": INT, "temperature": NUM, "top_k": INT,
        "top_p": NUM, "min_p": NUM, "frequency_penalty": NUM, "presence_penalty": NUM,
        "repetition_penalty": NUM, "seed": INT, "sampling_seed": INT, "n": INT,
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stop_token_ids": {"type": "array", "items": INT},
        "ignore_eos": BOOL, "skip_special_tokens": BOOL, "no_stop_trim": BOOL,
        "stream_interval": {"type": "integer", "minimum": 1},
        "spaces_between_special_tokens": BOOL, "custom_params": {"type": "object"},
        **{key: {**NULL, "description": f"refused unless null: {why}"}
           for key, why in S.REFUSED.items()}}}
# Decoding constraints (grammar/compiler.py): the shapes a client sends, so that a fuzzer
# generates them (the values it makes are mostly invalid grammars: 400s naming the field).
STR = {"type": "string"}
JSON_SCHEMA_VALUE: dict[str, Any] = {"anyOf": [{"type": "object"}, {**STR, "maxLength": 512},
                                               NULL]}
STRUCTURAL_TAG_VALUE: dict[str, Any] = {
    "type": "object", "required": ["structures", "triggers"],
    "properties": {
        "structures": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "required": ["begin", "end"],
            "properties": {"begin": STR, "end": STR, "schema": {"type": "object"}}}},
        "triggers": {"type": "array", "maxItems": 4, "items": STR}}}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "regex": {"anyOf": [{**STR, "maxLength": 128}, NULL],
              "description": "the output must match this regular expression"},
    "ebnf": {"anyOf": [{**STR, "maxLength": 512}, NULL],
             "description": "the output must match this grammar (GBNF or lark)"},
    "json_schema": {**JSON_SCHEMA_VALUE,
                    "description": "the output must be JSON valid against this schema"},
    "structural_tag": {"anyOf": [STRUCTURAL_TAG_VALUE, {**STR, "maxLength": 512}, NULL],
                       "description": "free text; each trigger opens its structure"},
}
RESPONSE_FORMAT: dict[str, Any] = {"anyOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"],
     "properties": {"type": {"const": "json_schema"}, "json_schema": {
         "type": "object", "required": ["name"],
         "properties": {"name": STR, "schema": {"type": "object"}, "strict": BOOL,
                        "description": STR}}}},
    {**STRUCTURAL_TAG_VALUE, "required": ["type", *STRUCTURAL_TAG_VALUE["required"]],
     "properties": {"type": {"const": "structural_tag"},
                    **STRUCTURAL_TAG_VALUE["properties"]}},
    NULL], "description": "at most one constraint per request (else 400)"}
assert set(CONSTRAINTS) == set(S.GRAMMAR_KEYS), "document every constraint key"
SAMPLING_PARAMS_SCHEMA["properties"].update(CONSTRAINTS)

# Top-level /generate fields refused when set: null, false or a list of nulls only.
UNSET_FEATURE: dict[str, Any] = {
    "anyOf": [NULL, {"const": False}, {"type": "array", "items": NULL}],
    "description": "refused (400) when set"}

# Routing replay on /generate (SGLang's fields): what a client reads in the document.
ROUTED_EXPERTS_DOC: dict[str, str] = {
    "return_routed_experts": (
        "MoE routing replay: the final object (or chunk) of each sample carries "
        "meta_info.routed_experts, base64 of little-endian int32 [prompt_tokens + "
        "completion_tokens - 1 - routed_experts_start_len, num_hidden_layers, "
        "num_experts_per_tok] (-1 in a dense layer's slots); aborted samples carry their "
        "partial output's. 400 for a dense model, or when the server was not started with "
        "--enable-return-routed-experts"),
    "routed_experts_start_len": (
        "the first position (of prompt + output) whose routing is returned; at most the "
        "prompt's length (else 400)"),
}


class WeightVersion(BaseModel):
    weight_version: str | None


class VllmStatus(BaseModel):
    """vLLM's answer ("paused", "resumed"), with the control call's outcome beside it."""

    model_config = ConfigDict(extra="allow")
    status: str


class IsPaused(BaseModel):
    is_paused: bool


# What one engine holds (engine/memory_report.py), bytes of its whole device group. Each
# property gets its own schema dict (the shared INT / NULL may gain bounds elsewhere).
def _int() -> dict[str, Any]:
    return {"type": "integer", "minimum": 0}


def _opt_int() -> dict[str, Any]:
    return {"anyOf": [_int(), {"type": "null"}]}


ENGINE_MEMORY_SCHEMA: dict[str, Any] = {
    "type": "object", "description": "what the engine holds: weights (the params' size, "
    "the extra copies its kernels run on, the bytes held in the canonical layout itself), "
    "the KV pool (bytes = (kv_pool_tokens + "
    "kv_pool_padding_tokens) x kv_bytes_per_token; how its size was chosen), the compiled "
    "step programs (count; XLA's scratch per program; generated code bytes, null where the "
    "backend does not report them); released parts count 0",
    "properties": {
        **{k: _int() for k in ("weights_bytes", "weights_params_bytes",
                               "weights_copies_bytes", "weights_canonical_bytes",
                               "kv_pool_bytes", "kv_pool_tokens",
                               "kv_pool_padding_tokens", "kv_bytes_per_token")},
        "kv_pool_rule": {"anyOf": [{"type": "string", "enum": ["explicit", "device memory",
                                                               "host memory"]},
                                   {"type": "null"}]},
        "kv_pool_budget_bytes": _opt_int(),
        "programs": {"type": "object", "properties": {
            "count": _int(), "generated_code_bytes": _opt_int(), "temp_bytes_max": _int(),
            "temp_bytes_total": _int()}, "required": ["count"]},
        "released": {"type": "array", "items": {"type": "string"}}},
    "required": ["weights_bytes", "kv_pool_bytes", "kv_pool_tokens", "kv_bytes_per_token",
                 "programs"]}
# The process's resident memory (multiserve/host/process_memory.py): every engine of the fleet.
PROCESS_MEMORY_SCHEMA: dict[str, Any] = {
    "type": "object", "description": "the serving process's resident memory (all its "
    "engines): VmRSS and VmHWM; rss_bytes null where the OS does not report it",
    "properties": {"rss_bytes": _opt_int(), "peak_rss_bytes": _opt_int()}}

# The engine's internal state (Engine.get_internal_state): the keys clients act on; the
# answer carries more (queue sizes, KV accounting, counters).
ENGINE_STATE_SCHEMA: dict[str, Any] = {
    "type": "object", "description": "one engine's internal state (more keys than listed)",
    "properties": {
        "engine_paused": {**BOOL, "description": "no step runs (pause_reasons is not empty)"},
        "pause_reasons": {"type": "array", "description": "why the engine is paused: the "
                          "user's pause_generation, a staged weight update, released memory",
                          "items": {"type": "string", "enum": list(PAUSE_REASONS)}},
        "memory_released": {"type": "array",
                            "items": {"type": "string", "enum": sorted(MEMORY_TAGS)}},
        "weight_version": {"type": "string"},
        "determinism": {"type": "object", "description": "the invariance plan this engine "
                        "calibrated on its backend: verified, problems, plan, probe_seconds, "
                        "cached, key (what decides kernels), key_hash",
                        "properties": {"verified": BOOL, "key_hash": {"type": "string"}},
                        "required": ["verified", "plan", "key_hash"]},
        "memory": ENGINE_MEMORY_SCHEMA},
    "required": ["engine_paused", "pause_reasons", "memory_released", "weight_version",
                 "determinism", "memory"]}
SERVER_INFO_SCHEMA: dict[str, Any] = {
    **ENGINE_STATE_SCHEMA, "description": "the server's settings and its engine's state",
    "properties": {**ENGINE_STATE_SCHEMA["properties"],
                   "enable_memory_saver": {**BOOL, "description": "sglang's server option, "
                                           "as set (memory release works either way)"},
                   "max_request_bytes": {**INT, "description": "larger bodies get 413"},
                   "max_prompt_chars": {**INT, "description": "longer prompts get 400 "
                                        "before they are tokenized"},
                   "process_memory": PROCESS_MEMORY_SCHEMA,
                   "internal_states": {"type": "array", "items": ENGINE_STATE_SCHEMA}},
    "required": [*ENGINE_STATE_SCHEMA["required"], "enable_memory_saver", "max_request_bytes",
                 "max_prompt_chars", "process_memory", "internal_states"]}


def control_bodies() -> tuple[dict[Key, type[ControlBody]], frozenset[Key],
                              dict[Key, list[dict[str, Any]]]]:
    """The control routes' documented bodies, the optional ones among them, and the query
    parameters of their GET spellings (from each body's fields)."""
    bodies: dict[Key, type[ControlBody]] = {}
    query: dict[Key, list[dict[str, Any]]] = {}
    for op in (*routed_ops("core"), *routed_ops("rl")):
        model = body_for(op)
        assert op.route is not None
        if model is None:
            continue
        for method in op.route.methods:
            for path in op.route.paths:
                if method == "GET":
                    if model.reads_query:
                        query[(method, path)] = query_parameters(model)
                else:
                    bodies[(method, path)] = model
    optional = frozenset(k for k, m in bodies.items() if m.optional_body)
    return bodies, optional, query


CONTROL_BODIES, OPTIONAL_BODIES, QUERY = control_bodies()
BODIES: dict[Key, Any] = {
    ("POST", "/v1/chat/completions"): P.ChatCompletionRequest,
    ("POST", "/v1/completions"): P.CompletionRequest,
    ("POST", "/generate"): N.GenerateRequestBody,
    ("POST", "/inference/v1/generate"): T.TokensGenerateRequest,
    ("POST", "/v1/score"): N.ScoreRequest,
    **CONTROL_BODIES,
    ("POST", "/parse_function_call"): PR.ParseFunctionCallBody,
    ("POST", "/separate_reasoning"): PR.SeparateReasoningBody,
    **WT.BODIES,  # vLLM's weight-transfer set-up (weight_transfer.py)
}
OPTIONAL_BODIES = OPTIONAL_BODIES | WT.OPTIONAL

CONTROL = Answer(ControlAnswer)
# vLLM's weight-transfer set-up: the disk backend answers 200, the rest 400 (never 200).
# SGLang's weights-update group routes are control operations (their entries below).
WT_ANSWERS: dict[Key, Answer] = {
    ("POST", "/init_weight_transfer_engine"): Answer(ControlAnswer, errors=("400", "401")),
}
ANSWERS: dict[Key, Answer] = {
    ("GET", "/v1/models"): Answer(P.ModelList, errors=("401",)),
    # streamed: one chunk per SSE event (chat: a delta; completions: OpenAI's legacy chunk
    # is the answer's shape with the new text; /generate: one sample's cumulative state)
    ("POST", "/v1/chat/completions"): Answer(P.ChatCompletionResponse,
                                             stream=P.ChatCompletionChunk, errors=GEN_ERRORS),
    ("POST", "/v1/completions"): Answer(P.CompletionResponse, stream=P.CompletionResponse,
                                        errors=GEN_ERRORS),
    ("POST", "/generate"): Answer(N.GenerateResponse, stream=N.GenerateResponse,
                                  one_or_list=True, errors=GEN_ERRORS),
    # vLLM's token-in/token-out: streamed, each chunk a choice's new ids
    ("POST", "/inference/v1/generate"): Answer(T.TokensGenerateResponse,
                                               stream=T.TokensGenerateResponse,
                                               errors=GEN_ERRORS),
    ("POST", "/v1/score"): Answer(N.ScoreResponse, errors=GEN_ERRORS),
    ("POST", "/parse_function_call"): Answer(PR.ParseFunctionCallAnswer, errors=("400", "401")),
    ("POST", "/separate_reasoning"): Answer(PR.SeparateReasoningAnswer, errors=("400", "401")),
    ("GET", "/health"): Answer(errors=("401", "503")),
    ("GET", "/health_generate"): Answer(errors=("401", "503")),
    ("GET", "/get_model_info"): Answer(errors=("401", "503")),
    ("GET", "/model_info"): Answer(errors=("401", "503")),
    ("GET", "/get_server_info"): Answer(SERVER_INFO_SCHEMA, errors=("401", "503")),
    ("GET", "/server_info"): Answer(SERVER_INFO_SCHEMA, errors=("401", "503")),
    ("GET", "/get_weight_version"): Answer(WeightVersion, errors=("401", "503")),
    ("GET", "/v1/loads"): Answer(errors=("401", "503")),
    ("GET", "/metrics"): Answer(text=True, errors=("401",)),
    **WT_ANSWERS,
    # vLLM's pause routes (vllm_pause.py); AReaL's vLLM-server spellings of the same
    ("POST", "/pause"): Answer(VllmStatus, errors=("400", "401", "409", "503")),
    ("POST", "/resume"): Answer(VllmStatus, errors=("400", "401", "503")),
    ("GET", "/is_paused"): Answer(IsPaused, errors=("401", "503")),
    ("POST", "/areal_pause_generation"): Answer(ControlAnswer, errors=("400", "401", "503")),
    ("POST", "/areal_continue_generation"): Answer(ControlAnswer,
                                                   errors=("400", "401", "503")),
    **{(m, path): CONTROL for op in (*routed_ops("core"), *routed_ops("rl"))
       if op.route is not None for m in op.route.methods for path in op.route.paths},
    # LoRA refusals: 404 an unknown adapter, 409 every slot taken / the adapter in use
    **{(m, path): Answer(ControlAnswer, errors=("400", "401", "404", "409", "503"))
       for op in routed_ops("core") if op.route is not None and "lora" in op.name
       for m in op.route.methods for path in op.route.paths},
}


# The ranges SamplingParams enforces (types.py), by the names clients send; declared so
# that a valid-looking request is valid. Context-length limits depend on the prompt and
# stay undeclared (the server answers 400 naming the parameter).
BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0, "maximum": 100},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "seed": {"minimum": 0, "maximum": 2**63 - 1},
    "sampling_seed": {"minimum": 0, "maximum": 2**63 - 1},
    "n": {"minimum": 1, "maximum": 64},
    "max_tokens": {"minimum": 0}, "max_completion_tokens": {"minimum": 0},
    "max_new_tokens": {"minimum": 0}, "min_tokens": {"minimum": 0},
    "min_new_tokens": {"minimum": 0},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "top_logprobs_num": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},  # completions: an integer
    "truncate_size": {"minimum": 1},
}


def _bound(props: dict[str, Any]) -> None:
    """Add BOUNDS to the numeric branch(es) of each known property, in place."""
    for name, bounds in BOUNDS.items():
        prop = props.get(name)
        if prop is None:
            continue
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") in ("integer", "number"):
                branch.update(bounds)


def _token_ids(prop: Any, vocab: int) -> None:
    """Bound every integer item (at any list depth) of a token-id property to the vocab."""
    if isinstance(prop, dict):
        if prop.get("type") == "integer":
            prop.update({"minimum": 0, "maximum": vocab - 1})
        for value in prop.values():
            _token_ids(value, vocab)
    elif isinstance(prop, list):
        for value in prop:
            _token_ids(value, vocab)


def _refiner(model_name: str, vocab: int) -> Any:
    def refine(components: dict[str, Any]) -> None:
        for name, field in (("GenerateRequestBody", "input_ids"), ("ScoreRequest", "items"),
                            ("ScoreRequest", "query"), ("ScoreRequest", "label_token_ids"),
                            ("CompletionRequest", "prompt")):
            _token_ids(components.get(name, {}).get("properties", {}).get(field), vocab)
        score = components.get("ScoreRequest", {}).get("properties", {})
        if "label_token_ids" in score:
            score["label_token_ids"]["minItems"] = 1
        chat = components.get("ChatCompletionRequest", {}).get("properties", {})
        if "messages" in chat:
            chat["messages"]["minItems"] = 1
        _bound(components.get("WeightsByNameBody", {}).get("properties", {}))
        body = components.get("GenerateRequestBody", {}).get("properties", {})
        if "sampling_params" in body:  # one dict for every prompt, or one per prompt
            body["sampling_params"] = {"anyOf": [
                SAMPLING_PARAMS_SCHEMA, NULL,
                {"type": "array", "items": {"anyOf": [SAMPLING_PARAMS_SCHEMA, NULL]}}]}
        for key in N.REFUSED_FEATURES:
            if key in body:
                body[key] = UNSET_FEATURE
        for key, text in ROUTED_EXPERTS_DOC.items():
            if key in body:
                body[key]["description"] = text
        _bound(SAMPLING_PARAMS_SCHEMA["properties"])
        _bound(body)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            props = components.get(name, {}).get("properties", {})
            props.update({k: v for k, v in CONSTRAINTS.items() if k in props})
            if "response_format" in props:
                props["response_format"] = RESPONSE_FORMAT
        for name in ("ChatCompletionRequest", "CompletionRequest", "GenerateRequestBody"):
            props = components.get(name, {}).get("properties", {})
            _bound(props)
            if "model" in props:  # any string (ignored, as sglang does)
                props["model"] = {"anyOf": [{"type": "string"}, NULL], "description":
                                  f"ignored: this server serves {model_name!r}"}
        stops = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": 16,
                            "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            if "stop" in components.get(name, {}).get("properties", {}):
                components[name]["properties"]["stop"] = stops
        SAMPLING_PARAMS_SCHEMA["properties"]["stop"] = {"anyOf": stops["anyOf"][:2]}
        _refine_tokens_generate(components, vocab, stops)
    return refine


def _refine_tokens_generate(components: dict[str, Any], vocab: int,
                            stops: dict[str, Any]) -> None:
    """/inference/v1/generate: prompt ids in the vocabulary (at least one), the sampling
    ranges, the refused options null only and the unsupported top-level ones unset."""
    body = components.get("TokensGenerateRequest", {}).get("properties", {})
    if "token_ids" in body:
        _token_ids(body["token_ids"], vocab)
        body["token_ids"]["minItems"] = 1
    for key in ("kv_transfer_params", "features"):
        if key in body:
            body[key] = UNSET_FEATURE
    if "model" in body:
        body["model"] = {"anyOf": [{"type": "string"}, NULL], "description": "ignored"}
    sp = components.get("TokensSamplingParams", {}).get("properties", {})
    _bound(sp)
    for key in T.REFUSED_OPTIONS:
        if key in sp:
            sp[key] = {**NULL, "description": "refused (400) unless null"}
    if "stop" in sp:
        sp["stop"] = stops
    if "stop_token_ids" in sp:
        _token_ids(sp["stop_token_ids"], vocab)


def document_engine_app(app: FastAPI, model_name: str, vocab_size: int, *,
                        bodies: dict[Key, Any] | None = None,
                        answers: dict[Key, Answer] | None = None,
                        query: dict[Key, list[dict[str, Any]]] | None = None) -> None:
    """Document `app` (serving `model_name`, the only value `model` may take, with token
    ids in [0, vocab_size)): the engine's routes that `app` has, plus `bodies`, `answers`
    and `query` of its own (the fleet's front door serves the generation routes)."""
    document(app, {**BODIES, **(bodies or {})}, {**ANSWERS, **(answers or {})},
             optional_bodies=OPTIONAL_BODIES,
             query={**QUERY, ("POST", "/pause"): PAUSE_PARAMETERS, **(query or {})},
             patch_components=_refiner(model_name, vocab_size))
