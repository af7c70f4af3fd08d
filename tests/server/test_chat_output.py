"""A chat reply split into reasoning, content and calls (server/chat_output.py), whole
and streamed at every split, and the parser options' path from the command line."""

from __future__ import annotations

import argparse

import pytest

from multiserve.server.chat_output import ChatOutputParser, ChatPiece

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
QWEN3 = ("<think>\nThe user wants the weather.\n</think>\n\nChecking.\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def _run(parser: ChatOutputParser, pieces: list[str]) -> ChatPiece:
    total = ChatPiece()
    for p in pieces:
        total += parser.feed(p)
    total += parser.flush()
    return total


def _summary(p: ChatPiece) -> tuple[str, str, list[tuple[int, str | None, str]]]:
    return p.reasoning, p.content, [(d.index, d.name, d.arguments) for d in p.calls]


def test_reasoning_then_calls_at_every_split():
    whole = _run(ChatOutputParser("qwen3", "hermes", TOOLS), [QWEN3])
    assert whole.reasoning == "The user wants the weather." and whole.content == "Checking."
    assert [d.arguments for d in whole.calls if d.name is None] == ['{"city": "Paris"}',
                                                                      '{"city": "Rome"}']
    for cut in range(len(QWEN3) + 1):
        got = _run(ChatOutputParser("qwen3", "hermes", TOOLS), [QWEN3[:cut], QWEN3[cut:]])
        assert _summary(got) == _summary(whole), cut


def test_no_parallel_calls_keeps_the_first_and_ids_are_stable():
    p = ChatOutputParser("qwen3", "hermes", TOOLS, parallel_tool_calls=False)
    got = _run(p, list(QWEN3))
    assert {d.index for d in got.calls} == {0} and "tool_call" not in got.content
    assert list(p.ids) == [0] and p.ids[0].startswith("call_") and len(p.ids[0]) == 29


def test_reasoning_held_until_complete_when_not_streamed():
    p = ChatOutputParser("qwen3", None, None, stream_reasoning=False)
    pieces = [p.feed(c) for c in QWEN3[:40]]
    assert all(x.reasoning == "" for x in pieces)
    rest = p.feed(QWEN3[40:])
    assert rest.reasoning == "The user wants the weather." and rest.content.startswith("Checking.")


@pytest.mark.parametrize("flags,want", [
    ([], (None, None, None)),
    (["--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1",
      "--chat-template", "t.jinja"], ("qwen25", "deepseek-r1", "t.jinja")),
])
def test_parser_options_reach_every_engine_server(flags, want, tmp_path, monkeypatch):
    from multiserve.cli import build_parser
    from multiserve.fleet.startup import fleet_config_from_args

    monkeypatch.chdir(tmp_path)
    args: argparse.Namespace = build_parser().parse_args(["serve", "--engines", "2", *flags])
    cfg = fleet_config_from_args(args)
    for s in cfg.servers:
        got = (s.tool_call_parser, s.reasoning_parser,
               s.chat_template and s.chat_template.removeprefix(str(tmp_path) + "/"))
        assert got == want


def test_unknown_parser_option_is_a_config_error():
    from multiserve.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ConfigError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")
