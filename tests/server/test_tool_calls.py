"""Tool calling and the parser endpoints over real HTTP (the session's tiny engine): the
SGLang endpoints, tools rendered into the prompt, bad input -> 4xx with an error body.
What the default model answers with tools is tests/server/test_tool_calls_default.py."""

from __future__ import annotations

import json

import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
STRICT_BAD = {"type": "function", "function": {
    "name": "bad", "strict": True, "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "(("}}}}}
PICK = {"type": "function", "function": {
    "name": "pick", "parameters": {"type": "object", "additionalProperties": False,
                                   "required": ["n"], "properties": {
                                       "n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
FLIP = {"type": "function", "function": {
    "name": "flip", "parameters": {"type": "object", "additionalProperties": False,
                                   "required": ["up"], "properties": {"up": {"type": "boolean"}}}}}
QWEN = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>')


def _error(r, status=400):
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_parse_function_call_endpoint(served):
    r = served.http.post("/parse_function_call", json={
        "text": QWEN, "tool_call_parser": "qwen25", "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json() == {"normal_text": "Sure.", "calls": [
        {"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Paris"}'}]}
    # another format, several calls
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    r = served.http.post("/parse_function_call", json={
        "text": text, "tool_call_parser": "mistral", "tools": [WEATHER]})
    assert [json.loads(c["parameters"])["city"] for c in r.json()["calls"]] == ["Rome", "Oslo"]


def test_separate_reasoning_endpoint(served):
    r = served.http.post("/separate_reasoning", json={
        "text": "<think>\nsimple\n</think>\n\nFour.", "reasoning_parser": "qwen3"})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "Four.", "reasoning_text": "simple"}
    r = served.http.post("/separate_reasoning", json={
        "text": "still thinking", "reasoning_parser": "deepseek-r1"})
    assert r.json() == {"text": "", "reasoning_text": "still thinking"}


@pytest.mark.parametrize("path,body,param", [
    ("/parse_function_call", {"text": "x", "tool_call_parser": "nope"}, "tool_call_parser"),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}, "reasoning_parser"),
    ("/separate_reasoning", {"text": "x"}, "reasoning_parser"),  # the server has none
    ("/parse_function_call", {"tool_call_parser": "hermes"}, "text"),
    ("/parse_function_call", {"text": 3, "tool_call_parser": "hermes"}, "text"),
    ("/parse_function_call", {"text": "x", "tools": [{"function": {}}]}, "tools[0].function.name"),
])
def test_parser_endpoints_refuse_bad_input(served, path, body, param):
    assert _error(served.http.post(path, json=body))["param"] == param


def test_server_info_names_the_parsers(served):
    info = served.state()
    assert info["tool_call_parser"] == "hermes"  # the tiny model's template shows none
    assert info["reasoning_parser"] is None


def _chat(served, **body):
    body.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return served.http.post("/v1/chat/completions", json={"max_tokens": 4, "temperature": 0,
                                                          **body})


def test_tools_render_into_the_prompt(served, idle_engine):
    plain = _chat(served).json()["usage"]["prompt_tokens"]
    with_tools = _chat(served, tools=[WEATHER])
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["usage"]["prompt_tokens"] > plain + 50
    # tool_choice none: tools are not shown to the model
    none = _chat(served, tools=[WEATHER], tool_choice="none").json()
    assert none["usage"]["prompt_tokens"] == plain
    # a history with a call and its result renders (arguments given as JSON text)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    r = _chat(served, tools=[WEATHER], messages=history)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > with_tools.json()["usage"]["prompt_tokens"]


def test_tools_rendered_text(tm):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    text = tm.render_chat(history, tools=[WEATHER])
    assert '<tools>[{"name": "get_weather"' in text
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in text
    # without tools nor tool turns the rendering is the template's own
    msgs = [{"role": "user", "content": "hi"}]
    assert tm.render_chat(msgs) == tm.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format"),
    ({"tools": [STRICT_BAD]}, "tools"),  # a strict tool's schema is compiled: refused
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "messages": [{"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": [WEATHER], "messages": [{"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_chat_tool_bad_input(served, body, param):
    err = _error(_chat(served, **body))
    assert err["param"] == param or (err["param"] or "").startswith(param), err


def test_completions_still_refuse_tools(served):
    r = served.http.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert _error(r)["param"] == "tools"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_return_a_valid_call(served, idle_engine, choice):
    """Enforced by the grammar: even the tiny random model returns a schema-valid call
    (bounded arguments, so that it ends within max_tokens)."""
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "pick"}}
    r = _chat(served, tools=[FLIP, PICK], tool_choice=tool_choice, max_tokens=96,
              parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls", choice0
    (call,) = [c["function"] for c in choice0["message"]["tool_calls"]]
    if choice == "named":
        assert call["name"] == "pick"
    args = json.loads(call["arguments"])
    assert args in ([{"n": n} for n in range(10)] + [{"up": True}, {"up": False}])


def test_strict_tools_under_auto(served, idle_engine):
    """A strict tool under auto: a grammar (text without a call start, or text then valid
    calls) is compiled and applied; a given response_format wins over it."""
    r = _chat(served, tools=[STRICT_WEATHER], max_tokens=24)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg.get("tool_calls") or "<tool_call>" not in (msg["content"] or "")
    r = _chat(served, tools=[STRICT_WEATHER], tool_choice="auto", max_tokens=24,
              response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
