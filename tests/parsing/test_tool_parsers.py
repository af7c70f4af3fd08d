"""Tool-call parsers on replies in each model family's real output format, non-streaming
and streamed split at every character boundary (the stream must give the same normal
text and calls as the whole)."""

from __future__ import annotations

import json

import pytest

from multiserve.parsing import ToolCallParser, detect_tool_call_parser, tool_call_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "hours": {"type": "array"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

# (parser, reply as the model writes it, expected normal text, expected calls)
CASES = [
    # Qwen2.5-7B-Instruct (hermes): text, then one block per call
    ("qwen25", 'I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
     "I will check both.",
     [(0, "get_weather", {"city": "Paris", "days": 2}), (1, "get_time", {"zone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
               '</tool_call>', "", [(0, "get_weather", {"city": "Zürich"})]),
    # a reply without calls passes through unchanged
    ("hermes", "The answer is 42 <tool> not a call.", "The answer is 42 <tool> not a call.", []),
    # a broken block is given back as text, verbatim
    ("hermes", 'Oops <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     'Oops <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    # Qwen3-Coder (XML): values typed by the schema
    ("qwen3_coder", "Let me look that up.\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n"
                    "</parameter>\n</function>\n</tool_call>",
     "Let me look that up.",
     [(0, "get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [9, 12]})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>", "",
     [(1, "get_time", {"zone": "UTC"}), (0, "get_weather", {"city": "42"})]),
    # Llama 3.1 (JSON, python tag) and Llama 3.2 (bare JSON reply)
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Tokyo"}}', "",
     [(0, "get_weather", {"city": "Tokyo"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
               '{"name": "get_time", "parameters": {"zone": "CET"}}', "",
     [(0, "get_weather", {"city": "Oslo"}), (1, "get_time", {"zone": "CET"})]),
    ("llama3", 'Here is JSON: {"a": 1}', 'Here is JSON: {"a": 1}', []),
    # Mistral 7B v0.3 (a JSON list) and the v11+ tokenizer form
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', "",
     [(0, "get_weather", {"city": "Lyon"}), (1, "get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 1}', "",
     [(0, "get_weather", {"city": "Nice", "days": 1})]),
    # pythonic (Llama 3.2 / 4 pythonic templates)
    ("pythonic", '[get_weather(city="San Francisco", days=3), get_time(zone=\'PST\')]', "",
     [(0, "get_weather", {"city": "San Francisco", "days": 3}), (1, "get_time", {"zone": "PST"})]),
    ("pythonic", "See [the docs](https://x.y) and [1, 2].", "See [the docs](https://x.y) and [1, 2].",
     []),
    ("pythonic", "<|python_start|>[get_time(zone=\"UTC\")]<|python_end|>", "",
     [(1, "get_time", {"zone": "UTC"})]),
    # DeepSeek-V3 (and the V3.1 form)
    ("deepseekv3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                   "get_weather\n```json\n{\"city\": \"Beijing\"}\n```<｜tool▁call▁end｜>\n"
                   "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
                   "{\"zone\": \"Asia/Shanghai\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Checking.",
     [(0, "get_weather", {"city": "Beijing"}), (1, "get_time", {"zone": "Asia/Shanghai"})]),
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                   "{\"city\": \"Seoul\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "",
     [(0, "get_weather", {"city": "Seoul"})]),
]


def _expected(calls):
    return [(i, n, json.dumps(a, ensure_ascii=False)) for i, n, a in calls]


@pytest.mark.parametrize("name,text,normal,calls", CASES)
def test_non_streaming(name, text, normal, calls):
    got_text, got = tool_call_parser(name, TOOLS).parse(text)
    assert got_text == normal
    assert [(c.tool_index, c.name, c.parameters) for c in got] == _expected(calls)


def _stream(p: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    text, names, args = "", {}, {}
    for res in [p.feed(x) for x in pieces] + [p.flush()]:
        text += res.normal_text
        for d in res.calls:
            if d.name is not None:
                assert d.index not in names and d.arguments == ""  # first delta: the name
                names[d.index] = d.name
            else:
                assert d.index in names  # arguments only after the name
                args[d.index] = args.get(d.index, "") + d.arguments
    return text, [(i, names[i], args.get(i, "")) for i in sorted(names)]


@pytest.mark.parametrize("name,text,normal,calls", CASES)
def test_streaming_at_every_split_equals_non_streaming(name, text, normal, calls):
    whole_text, whole = tool_call_parser(name, TOOLS).parse(text)
    want = [(i, c.name, c.parameters) for i, c in enumerate(whole)]
    for cut in range(len(text) + 1):
        assert _stream(tool_call_parser(name, TOOLS), [text[:cut], text[cut:]]) == \
            (whole_text, want), cut
    assert _stream(tool_call_parser(name, TOOLS), list(text)) == (whole_text, want)


@pytest.mark.parametrize("name,text,normal,calls", [c for c in CASES if c[3]])
def test_nothing_of_a_call_leaks_into_streamed_text(name, text, normal, calls):
    p, seen = tool_call_parser(name, TOOLS), ""
    for ch in text:
        seen += p.feed(ch).normal_text
        assert seen == normal[:len(seen)], seen  # only ever a prefix of the final text


def test_unknown_tools_are_dropped_and_no_tools_accepts_any():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert tool_call_parser("hermes", TOOLS).parse(text) == ("", [])
    _, calls = tool_call_parser("hermes").parse(text)
    assert [(c.tool_index, c.name, c.parameters) for c in calls] == [(-1, "rm_rf", "{}")]


def test_unknown_parser_name_is_a_key_error():
    with pytest.raises(KeyError, match="known"):
        tool_call_parser("nope")


@pytest.mark.parametrize("template,name", [
    ("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", "hermes"),
    ("<tool_call>\n<function=example_function_name>\n<parameter=x>", "qwen3_coder"),
    ("{{- '<|python_tag|>' }}", "llama3"),
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("[func_name1(params_name1=params_value1)]", "pythonic"),
    ("<｜tool▁calls▁begin｜>", "deepseekv3"),
    ("{{ message['content'] }}", None),
    (None, None),
])
def test_parser_chosen_from_the_chat_template(template, name):
    assert detect_tool_call_parser(template) == name
