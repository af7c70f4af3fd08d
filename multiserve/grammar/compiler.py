"""`GrammarCompiler`: a request's constraint -> a validated, cached `Grammar`.

Owns the translations (all to llguidance grammar text) of:
- `json_schema` (a schema object or its JSON text), `json_object` (any JSON object);
- `regex`; `ebnf` (GBNF as SGLang / llama.cpp write it, or lark);
- `structural_tag` (SGLang / OpenAI: `{"structures": [{"begin", "schema", "end"}],
  "triggers": [...]}`: free text in which each trigger starts its structure);
- tool calls (`tool_call_grammar`): the hermes `<tool_call>` form with schema-valid
  arguments, for tool_choice `required` and a named function, and (text or calls) for
  `auto` with strict tools.

Invariants:
- JSON whitespace is capped (`JSON_WHITESPACE`: at most 16 blanks between two tokens of
  the JSON text), so a weak model cannot spend its budget on blanks.
- A compile runs on this compiler's worker threads, never the caller's (the HTTP event
  loop) or the engine's, and is bounded by `timeout_s`: past it, or on any grammar error,
  `GrammarError` (a ValueError naming the request field) is raised and nothing is cached.
- The cache maps (kind, source) to the compiled Grammar (LRU, `cache_size` entries);
  compiling the same constraint twice builds one matcher.
- jax-free and imports nothing of the server or the engine.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from multiserve.grammar.grammar import Grammar

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
DEFAULT_TIMEOUT_S = 10.0


class GrammarError(ValueError):
    """An invalid or too costly constraint; `field` names the request field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _json_text(value: Any, field_name: str) -> dict[str, Any] | bool:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(field_name, f"not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(field_name, "must be a JSON schema object")
    return value


def _schema_grammar(schema: Any, field_name: str) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            _json_text(schema, field_name), defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    except GrammarError:
        raise
    except ValueError as exc:
        raise GrammarError(field_name, str(exc)) from None


def _lark_json(schema: Any) -> str:
    """A lark `%json` body for `schema` (whitespace capped as everywhere)."""
    body = dict(schema) if isinstance(schema, dict) else {}
    guidance = dict(body.get("x-guidance") or {})
    guidance.setdefault("whitespace_pattern", JSON_WHITESPACE)
    body["x-guidance"] = guidance
    return "%json " + json.dumps(body, ensure_ascii=False)


def structural_tag_grammar(tag: Any, field_name: str = "structural_tag") -> str:
    """SGLang's structural tag: free text, where each trigger opens one of its structures
    (begin, then JSON matching schema, then end)."""
    import llguidance

    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as exc:
            raise GrammarError(field_name, f"not valid JSON: {exc}") from None
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) \
            or not isinstance(tag.get("triggers"), list) or not tag["triggers"] \
            or not tag["structures"]:
        raise GrammarError(field_name, "must be an object with non-empty 'structures' "
                           "([{begin, schema, end}]) and 'triggers' (strings)")
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str):
            raise GrammarError(f"{field_name}.structures[{i}]", "needs 'begin' and 'end' strings")
        trigger = next((t for t in tag["triggers"] if isinstance(t, str) and t
                        and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"{field_name}.structures[{i}]",
                               "'begin' starts with none of the triggers")
        schema = s.get("schema", s.get("parameters", {}))
        _json_text(schema, f"{field_name}.structures[{i}].schema")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], end=s["end"],
                                         grammar=json.loads(_lark_json(
                                             _json_text(schema, field_name))[6:])))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def tool_call_grammar(tools: Sequence[dict[str, Any]], name: str | None, parallel: bool,
                      list_form: bool, free_text: bool = False) -> str:
    """The hermes tool-call form: `<tool_call>` blocks whose JSON is
    `{"name": <a tool>, "arguments": <valid for that tool's parameters>}` (only `name`'s
    tool when given). `list_form`: one block holding a JSON list of calls (what the generic
    tool prompt asks for), else one object per block (Qwen / Hermes templates). A named
    tool gives exactly one call (as SGLang and vLLM: `parallel` does not apply); else at
    most one call unless `parallel`. `free_text` (tool_choice auto with strict tools):
    either text that never writes `<tool_call>`, or text then the calls (nothing after
    them)."""
    parallel = parallel and name is None
    options = []
    for t in tools:
        fn = t.get("function", t)
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "additionalProperties": False,
                        "required": ["name", "arguments"],
                        "properties": {"name": {"const": fn["name"]}, "arguments": params}})
    call = options[0] if len(options) == 1 else {"anyOf": options}
    if free_text:
        # the text-only branch cannot hold the opening tag; the other is lazy: its text
        # ends at the first `<tool_call>`, where the calls begin
        head = ("%llguidance {}\nstart: TEXT_ONLY | opening calls_rest\n"
                "TEXT_ONLY: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
                "opening[lazy]: /(.|\\n)*/ \"<tool_call>\"\n")
    else:
        head = "%llguidance {}\nstart: \"<tool_call>\" calls_rest\n"
    if list_form:
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
        if not parallel:
            array["maxItems"] = 1
        return (head + "calls_rest: calls \"</tool_call>\"\n"
                f"calls: {_lark_json(array)}\n")
    more = " block*" if parallel else ""
    return (head + "calls_rest: \"\\n\" call \"\\n</tool_call>\"" + more + "\n"
            "block: \"<tool_call>\\n\" call \"\\n</tool_call>\"\n"
            f"call: {_lark_json(call)}\n")


class GrammarCompiler:
    """Compiles constraints for one tokenizer (shared by every request of a server)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = 256,
                 workers: int = 2) -> None:
        """`tokenizer_json`: the HF `tokenizers` serialisation (tokenizer.json text);
        `vocab_size`: the engine's logits width; `eos_ids`: the ids that end a sample
        (allowed once the grammar is complete)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_ids = [int(e) for e in eos_ids]
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._tokenizer: Any = None
        self.compile_seconds: dict[tuple[str, str], float] = {}

    @classmethod
    def for_hf_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
                         **kwargs: Any) -> GrammarCompiler:
        """From a fast (HF `tokenizers`-backed) tokenizer."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        return cls(backend.to_str(), vocab_size, eos_ids, **kwargs)

    def _ll_tokenizer(self) -> Any:
        """The llguidance tokenizer, built once (costly: docs/performance.md §9). Its
        vocabulary is the engine's logits width, or the tokenizer's own where that is
        larger (a test model smaller than its tokenizer: the masks are then cut to the
        logits width)."""
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size,
                        eos_token=self.eos_ids or None)
                except ValueError:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, eos_token=self.eos_ids or None)
            return self._tokenizer

    def source(self, kind: str, spec: Any, field_name: str) -> str:
        """The llguidance grammar text of a request constraint (raises GrammarError)."""
        import llguidance

        if kind == "json_schema":
            return _schema_grammar(spec, field_name)
        if kind == "json_object":
            return _schema_grammar({"type": "object"}, field_name)
        if kind == "regex":
            if not isinstance(spec, str):
                raise GrammarError(field_name, "must be a string")
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "ebnf":
            if not isinstance(spec, str) or not spec.strip():
                raise GrammarError(field_name, "must be a non-empty grammar string")
            try:
                return llguidance.grammar_from("ebnf", spec)
            except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors
                raise GrammarError(field_name, f"invalid grammar: {exc}") from None
        if kind == "structural_tag":
            return structural_tag_grammar(spec, field_name)
        if kind == "tool_call":
            return str(spec)
        raise GrammarError(field_name, f"unknown grammar kind {kind!r}")

    def compile(self, kind: str, spec: Any, field_name: str | None = None) -> Grammar:
        """The cached Grammar for a constraint, compiled on a worker thread (blocks the
        caller at most `timeout_s`; async callers use `acompile`)."""
        return self._submit(kind, spec, field_name or kind).result()

    async def acompile(self, kind: str, spec: Any, field_name: str | None = None) -> Grammar:
        import asyncio

        return await asyncio.wrap_future(self._submit(kind, spec, field_name or kind))

    def _submit(self, kind: str, spec: Any, field_name: str) -> Any:
        from concurrent.futures import Future

        done: Future[Grammar] = Future()
        try:
            source = self.source(kind, spec, field_name)
        except GrammarError as exc:
            done.set_exception(exc)
            return done
        key = (kind, source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done.set_result(hit)
                return done
        work = self._pool.submit(self._build, kind, source, field_name)

        def wait() -> None:
            try:
                done.set_result(work.result(timeout=self.timeout_s))
            except FutureTimeout:
                done.set_exception(GrammarError(
                    field_name, f"grammar compile exceeded {self.timeout_s:g} s"))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

        threading.Thread(target=wait, daemon=True, name="grammar-wait").start()
        return done

    def _build(self, kind: str, source: str, field_name: str) -> Grammar:
        import time

        import llguidance

        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise GrammarError(field_name, f"invalid {kind.replace('_', ' ')}: "
                               f"{matcher.get_error()}")
        grammar = Grammar(kind, source, int(self._ll_tokenizer().vocab_size), matcher)
        with self._lock:
            self.compile_seconds[(kind, source)] = time.perf_counter() - t0
            self._cache[(kind, source)] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar
