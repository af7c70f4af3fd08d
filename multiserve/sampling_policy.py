"""sglang's `sampling_params` dict -> `SamplingParams`: the one key policy, shared by the
HTTP side (native /generate) and the Python API (`Engine.generate(sampling_params={...})`).

Owns the key policy: every key sglang's SamplingParams accepts is either honoured, or
accepted as a no-op because it cannot change our output (the reason is written next to
it), or refused with a 400 that names it when it is set. A key sglang does not know is
refused too (sglang itself rejects unknown keys). `null` means "the default", as in
sglang. Nothing is ever silently ignored.

Invariants: jax-free and below both sides: it imports only `multiserve.types`, so the
engine can use it without knowing the HTTP side (tests/test_import_layers.py); range
checks stay in `SamplingParams` (errors name the client's key).
"""

from __future__ import annotations

from typing import Any

from multiserve.types import SamplingParams, SamplingParamsError

# Keys mapped onto SamplingParams fields of the same name (`seed` is our own extension,
# kept for existing clients; sglang's name for it is `sampling_seed`).
HONOURED = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "stop",
            "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "seed")
# Honoured by the server itself, not by SamplingParams.
SERVER_KEYS = ("sampling_seed", "stream_interval")
# Accepted; nothing to do here:
# - spaces_between_special_tokens: sglang hands it to the tokenizer's decode, where a fast
#   (`tokenizers`) tokenizer, the only kind we load, ignores it: sglang's text is the same
#   for both values, and so is ours.
# - custom_params: read only by a custom logit processor (refused at the top level of the
#   request); sglang ignores it otherwise.
NO_OP = ("spaces_between_special_tokens", "custom_params")
# Constraints (at most one per request): compiled by the caller into a Grammar
# (multiserve/grammar) and passed to `to_sampling_params(grammar=...)`.
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
# Refused when set: we cannot honour them.
REFUSED = {
    "stop_regex": "regex stop conditions are not supported; use 'stop' strings",
    "logit_bias": "logit_bias is not supported",
}
DEFAULT_MAX_NEW_TOKENS = 128  # sglang's default


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_set(key: str, value: Any) -> bool:
    if value is None:
        return False
    return not (key == "logit_bias" and value == {})  # an empty bias changes nothing


def check_keys(raw: dict[str, Any]) -> None:
    """Refuse (SamplingParamsError naming the key) unknown keys and set REFUSED ones."""
    known = set(HONOURED) | set(SERVER_KEYS) | set(NO_OP) | set(REFUSED) | set(GRAMMAR_KEYS)
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise SamplingParamsError(
            unknown[0], f"unknown sampling parameter(s) {unknown} in sampling_params; "
                        f"known: {sorted(known)}")
    for key, why in REFUSED.items():
        if _is_set(key, raw.get(key)):
            raise SamplingParamsError(key, why)


def grammar_key(raw: dict[str, Any] | None) -> tuple[str, Any] | None:
    """(key, value) of the one constraint in a sampling dict, or None; two or more set:
    SamplingParamsError."""
    given = [(k, raw[k]) for k in GRAMMAR_KEYS if raw and raw.get(k) is not None]
    if len(given) > 1:
        raise SamplingParamsError(given[1][0], "give at most one of "
                                  f"{', '.join(GRAMMAR_KEYS)} (got {given[0][0]} too)")
    return given[0] if given else None


def _seed(raw: dict[str, Any]) -> tuple[Any, str]:
    """sglang's per-request seed (`sampling_seed`), or our `seed`: (value, key used)."""
    ours, theirs = raw.get("seed"), raw.get("sampling_seed")
    if ours is not None and theirs is not None and ours != theirs:
        raise SamplingParamsError("sampling_seed", f"differs from seed ({theirs!r} != "
                                  f"{ours!r}); give one of them")
    return (theirs, "sampling_seed") if theirs is not None else (ours, "seed")


def stream_interval(raw: dict[str, Any]) -> int:
    """Tokens between two streamed chunks (sglang's stream_interval; default 1)."""
    value = raw.get("stream_interval")
    if value is None:
        return 1
    if not _is_int(value) or value < 1:
        raise SamplingParamsError("stream_interval", f"must be an integer >= 1, got {value!r}")
    return int(value)


def to_sampling_params(raw: dict[str, Any] | None, *, return_logprob: bool = False,
                       top_logprobs_num: int = 0,
                       token_ids_logprob: tuple[int, ...] | None = None,
                       grammar: Any = None) -> SamplingParams:
    """The engine's SamplingParams for one sglang `sampling_params` dict. Raises
    SamplingParamsError whose `field` is the client's key. `grammar`: the compiled
    constraint (multiserve/grammar `Grammar`) of the dict's constraint key; a constraint
    key given without it is refused (only the HTTP server compiles grammars)."""
    raw = dict(raw or {})
    check_keys(raw)
    constraint = grammar_key(raw)
    if constraint is not None and grammar is None:
        raise SamplingParamsError(constraint[0], "constrained decoding needs a compiled "
                                  "grammar: send it through the HTTP server, or pass "
                                  "SamplingParams(grammar=GrammarCompiler(...).compile(...))")
    given = {k: raw[k] for k in HONOURED if raw.get(k) is not None}
    given.pop("seed", None)
    seed, seed_key = _seed(raw)
    stream_interval(raw)  # validated here, used by the streaming response
    if "stop" in given and not isinstance(given["stop"], (str, list)):
        raise SamplingParamsError("stop", "must be a string or a list of strings")
    if "stop_token_ids" in given and not isinstance(given["stop_token_ids"], list):
        raise SamplingParamsError("stop_token_ids", "must be a list of integers")
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if key in given and not isinstance(given[key], bool):
            raise SamplingParamsError(key, "must be a boolean")
    max_new = given.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    try:
        return SamplingParams(max_new_tokens=max_new, seed=seed, grammar=grammar,
                              return_logprob=return_logprob,
                              top_logprobs_num=top_logprobs_num,
                              token_ids_logprob=token_ids_logprob, **given)
    except SamplingParamsError as exc:
        if exc.field == "seed" and seed_key != "seed":
            raise SamplingParamsError(seed_key, str(exc).split(":", 1)[1].strip()) from None
        raise


def per_prompt(sampling_params: dict[str, Any] | list[Any] | None, num_prompts: int,
               is_batch: bool) -> list[dict[str, Any]]:
    """One sampling dict per prompt. sglang's shapes: one dict (or null) for every prompt,
    or a list with one dict per prompt (tunix sends that); every dict must ask for the
    same `n` (sglang refuses mixed parallel-sample counts)."""
    if sampling_params is None or isinstance(sampling_params, dict):
        return [dict(sampling_params or {})] * num_prompts
    if not is_batch and len(sampling_params) != 1:
        raise SamplingParamsError("sampling_params", "a single prompt takes one dict (or a "
                                  f"list of exactly one), got a list of {len(sampling_params)}")
    if is_batch and len(sampling_params) != num_prompts:
        raise SamplingParamsError("sampling_params", f"need one dict per prompt: got "
                                  f"{len(sampling_params)} for {num_prompts} prompts")
    out = []
    for i, sp in enumerate(sampling_params):
        if sp is not None and not isinstance(sp, dict):
            raise SamplingParamsError(f"sampling_params.{i}", "must be an object")
        out.append(dict(sp or {}))
    ns = {d.get("n") or 1 for d in out}
    if len(ns) > 1:
        raise SamplingParamsError("sampling_params", f"every dict must ask for the same n "
                                  f"(got {sorted(ns, key=str)})")
    return out
