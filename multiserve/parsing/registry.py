"""The tool-call parsers by name, and the choice of one from a model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from multiserve.parsing.base import ToolCallParser
from multiserve.parsing.deepseekv3 import DeepSeekV3Parser
from multiserve.parsing.hermes import HermesParser
from multiserve.parsing.llama3 import Llama3Parser
from multiserve.parsing.mistral import MistralParser
from multiserve.parsing.pythonic import PythonicParser
from multiserve.parsing.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseekv3": DeepSeekV3Parser,
}

# What a chat template writes for tool calls -> the parser that reads them. First hit
# wins: qwen3_coder's template also writes <tool_call>, so it is checked before hermes.
TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),
    ("<｜tool▁calls▁begin｜>", "deepseekv3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ("[func_name1(", "pythonic"),
    ("<tool_call>", "hermes"),
)


def tool_call_parser(name: str, tools: Sequence[Any] | None = None) -> ToolCallParser:
    """A fresh parser for one output; KeyError naming the known ones if `name` is unknown."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise KeyError(f"unknown tool call parser {name!r}; known: "
                       f"{', '.join(sorted(TOOL_PARSERS))}")
    return cls(tools)


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format calls for, or None if it shows none."""
    if not chat_template:
        return None
    for marker, name in TEMPLATE_MARKERS:
        if marker in chat_template:
            return name
    return None
