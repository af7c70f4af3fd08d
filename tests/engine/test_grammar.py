"""Grammar-constrained decoding in the engine (issue 31): every constrained sample is in
its grammar's language, and constrained outputs are bitwise identical (ids and raw
logprobs) alone or batched beside unconstrained rows, across a retract pause, and across
abort + resubmit of the partial output (`grammar_resumed`: the matcher replays it); an
unconstrained row beside constrained ones is untouched; speculation never drafts for a
constrained request, so the speculating engine gives the same constrained outputs.

The tiny model's vocabulary is the first 512 SmolLM2 ids: masks are cut to that width, so
the grammars here are ones that single-byte tokens can spell.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger

from multiserve.grammar.compiler import GrammarCompiler
from multiserve.types import SamplingParams

WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,4}\."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    return GrammarCompiler.for_hf_tokenizer(tok, TINY_VOCAB, [2])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 40))]
            for _ in range(n)]


def _params(compiler: GrammarCompiler, i: int, kind: str = "regex") -> SamplingParams:
    grammar = compiler.compile(kind, WORDS if kind == "regex" else SCHEMA)
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=77 + i, max_new_tokens=48,
                              grammar=grammar, return_logprob=True)
    return SamplingParams(temperature=0.0, max_new_tokens=48, grammar=grammar,
                          return_logprob=True)


def _free(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=500 + i, max_new_tokens=24, ignore_eos=True,
                          return_logprob=True)


def _tokens(outs: dict) -> dict:
    return {k: (o.output_ids, tuple(t.logprob for t in o.logprobs), o.finish_reason)
            for k, o in outs.items()}


def _run(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    col = Collector(engine)
    col.submit_all(prompts, params)
    return _tokens(col.wait())


@pytest.mark.parametrize("kind", ["regex"])  # JSON: tests/server (the default model)
def test_constrained_outputs_are_in_the_language(tiny_engine: Any, compiler: GrammarCompiler,
                                                 tokenizer: Any, kind: str) -> None:
    prompts = _prompts(4)
    outs = _run(tiny_engine, prompts, [_params(compiler, i, kind) for i in range(4)])
    for key, (ids, lps, finish) in outs.items():
        text = tokenizer.decode(list(ids))
        assert finish == "stop", (key, text)
        if kind == "regex":
            assert re.fullmatch(WORDS, text), (key, text)
        else:
            value = json.loads(text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99, text
        assert len(lps) == len(ids)  # raw logprobs kept for every emitted token


def test_batching_leaves_both_kinds_of_rows_unchanged(tiny_engine: Any,
                                                      compiler: GrammarCompiler) -> None:
    prompts = _prompts(6, seed=9)
    constrained = [_params(compiler, i) for i in range(3)]
    free = [_free(i) for i in range(3)]
    alone_c = {(f"c{i}", 0): _run(tiny_engine, [prompts[i]], [constrained[i]])[("r0", 0)]
               for i in range(3)}
    alone_f = _run(tiny_engine, prompts[3:], free)
    mixed = _run(tiny_engine, prompts[:3] + prompts[3:], constrained + free)
    for i in range(3):
        assert mixed[(f"r{i}", 0)] == alone_c[(f"c{i}", 0)]
        assert mixed[(f"r{3 + i}", 0)] == alone_f[(f"r{i}", 0)]


def test_retract_pause_and_overlap_off_keep_constrained_outputs(
        tiny_engine: Any, tiny_engine_no_overlap: Any, trigger: Trigger,
        compiler: GrammarCompiler) -> None:
    prompts = _prompts(4, seed=11)
    params = [_params(compiler, i) for i in range(4)]
    want = _run(tiny_engine, prompts, params)
    assert _run(tiny_engine_no_overlap, prompts, params) == want
    hook = AtTokens(trigger, "r0", 3,
                    lambda: tiny_engine.acontrol("pause_generation", mode="retract"))
    col = Collector(tiny_engine, on_output=hook)
    col.submit_all(prompts, params)
    hook.wait()
    assert tiny_engine.continue_generation().ok
    assert _tokens(col.wait()) == want


def test_abort_then_resubmit_with_replayed_grammar(tiny_engine: Any, trigger: Trigger,
                                                   compiler: GrammarCompiler) -> None:
    prompts = _prompts(3, seed=13)
    params = [_params(compiler, i) for i in range(3)]
    want = _run(tiny_engine, prompts, params)
    hook = AtTokens(trigger, "r0", 4, lambda: tiny_engine.acontrol("abort_request",
                                                                   abort_all=True))
    col = Collector(tiny_engine, on_output=hook)
    col.submit_all(prompts, params)
    hook.wait()
    partial = col.wait()
    resumed = Collector(tiny_engine)
    for i, prompt in enumerate(prompts):
        part = partial[(f"r{i}", 0)]
        if part.finish_reason == "abort":
            resumed.submit(f"r{i}", prompt + list(part.output_ids), params[i].with_updates(
                max_new_tokens=params[i].max_new_tokens - len(part.output_ids),
                grammar_resumed=len(part.output_ids)))
    rest = resumed.wait()
    assert rest, "no request was resumed"
    for i in range(3):
        key = (f"r{i}", 0)
        part = partial[key]
        ids, lps = list(part.output_ids), [t.logprob for t in part.logprobs]
        finish = part.finish_reason
        if key in rest:
            ids += rest[key].output_ids
            lps += [t.logprob for t in rest[key].logprobs]
            finish = rest[key].finish_reason
        assert (tuple(ids), finish) == (want[key][0], want[key][2])
        assert lps == pytest.approx(list(want[key][1]), abs=1e-4)


def test_speculating_engine_gives_the_same_constrained_outputs(
        tiny_engine: Any, tiny_engine_spec: Any, compiler: GrammarCompiler) -> None:
    prompts = _prompts(4, seed=17)
    params = [_params(compiler, i) for i in range(2)] + [_free(i) for i in range(2)]
    want = _run(tiny_engine, prompts, params)
    got = _run(tiny_engine_spec, prompts, params)
    for i in range(2):
        assert got[(f"r{i}", 0)] == want[(f"r{i}", 0)]


def test_bad_grammars_are_refused_with_the_field(compiler: GrammarCompiler) -> None:
    from multiserve.grammar.compiler import GrammarError

    for kind, spec in [("regex", "(["), ("json_schema", "{not json"),
                       ("json_schema", {"type": "nonsense"}), ("ebnf", "root ::= ("),
                       ("structural_tag", {"structures": [], "triggers": []})]:
        with pytest.raises(GrammarError) as err:
            compiler.compile(kind, spec)
        assert err.value.field == kind


def test_a_token_the_grammar_rejects_ends_the_sample_with_an_error(
        tiny_engine: Any, compiler: GrammarCompiler, tokenizer: Any) -> None:
    """A resumed output the grammar never admitted (digits under a lowercase-words regex)
    leaves the matcher in its error state: the sample ends with "abort" and an error
    naming the rejected token, not a bare abort."""
    bad = tokenizer.encode("123 456", add_special_tokens=False)
    params = _params(compiler, 0).with_updates(grammar_resumed=len(bad))
    col = Collector(tiny_engine)
    col.submit("r0", _prompts(1, seed=21)[0] + bad, params)
    out = col.wait()[("r0", 0)]
    assert out.finish_reason == "abort" and out.output_ids == ()
    assert out.error is not None and out.error.startswith("the grammar rejected tokens ")


def test_a_sampled_token_the_grammar_rejects_names_it_in_the_error(
        compiler: GrammarCompiler, tokenizer: Any) -> None:
    """The scheduler's verdict on an emitted token the matcher rejects: "abort", and the
    Req's error (what its final output carries) names the token."""
    from multiserve.engine.sched.request import Req
    from multiserve.engine.sched.scheduler import Scheduler
    from multiserve.grammar.matcher_state import GrammarState

    params = _params(compiler, 0)
    req = Req(rid="r", index=0, prompt_ids=[5], params=params, seed=0, sink=lambda d: None)
    req.grammar = GrammarState(params.grammar)
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    assert Scheduler._grammar_verdict(req, digit) == "abort"
    assert req.error is not None and req.error.startswith(f"the grammar rejected token {digit}")
    assert req.next_delta("v").error == req.error


@pytest.mark.parametrize("list_form", [False, True])
def test_strict_tools_under_auto_allow_text_or_valid_calls(
        compiler: GrammarCompiler, tokenizer: Any, list_form: bool) -> None:
    """tool_choice auto with a strict tool: text that never opens a call, or text then
    calls whose arguments validate; nothing after the calls."""
    from multiserve.grammar.compiler import tool_call_grammar

    add = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
    grammar = compiler.compile("tool_call", tool_call_grammar([add], None, True, list_form,
                                                              free_text=True))

    def accepts(text: str) -> bool:
        m = grammar.new_matcher()
        ok = m.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not m.is_error() and m.is_accepting()

    call = '{"name": "add", "arguments": {"n": 4, "ok": true}}'
    bad = '{"name": "add", "arguments": {"n": 400, "ok": true}}'
    block = (lambda c: f"<tool_call>[{c}]</tool_call>") if list_form else (
        lambda c: f"<tool_call>\n{c}\n</tool_call>")
    assert accepts("no tool needed here.")
    assert accepts(block(call)) and accepts("Let me add. " + block(call))
    assert not accepts(block(bad))
    assert not accepts(block(call.replace('"add"', '"sub"')))
    assert not accepts("text <tool_call> then text")
    assert not accepts(block(call) + " and more text")


@pytest.mark.parametrize("list_form", [False, True])
def test_named_tool_is_one_call_and_parallel_keeps_its_meaning(
        compiler: GrammarCompiler, tokenizer: Any, list_form: bool) -> None:
    """A named tool_choice admits exactly one call even with parallel_tool_calls true (as
    SGLang and vLLM); `required` admits several calls with parallel true, one with false."""
    from multiserve.grammar.compiler import tool_call_grammar

    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}}
             for n in ("add", "sub")]
    call = '{"name": "add", "arguments": {"n": 4, "ok": true}}'
    if list_form:
        one, two = f"<tool_call>[{call}]</tool_call>", f"<tool_call>[{call}, {call}]</tool_call>"
    else:
        block = f"<tool_call>\n{call}\n</tool_call>"
        one, two = block, block + block

    def accepts(name: str | None, parallel: bool, text: str) -> bool:
        grammar = compiler.compile("tool_call", tool_call_grammar(tools, name, parallel,
                                                                  list_form))
        m = grammar.new_matcher()
        ok = m.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not m.is_error() and m.is_accepting()

    assert accepts("add", True, one) and not accepts("add", True, two)
    assert accepts("add", False, one) and not accepts("add", False, two)
    assert accepts(None, True, one) and accepts(None, True, two)
    assert accepts(None, False, one) and not accepts(None, False, two)
