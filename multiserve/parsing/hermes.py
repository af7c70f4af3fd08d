"""Hermes / Qwen2.5 tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call (a JSON list of calls inside one block is accepted too, as small
models trained on it write). Registered as `hermes` and `qwen25`."""

from __future__ import annotations

from multiserve.parsing.base import Taken, ToolCallParser
from multiserve.parsing.json_call import loads_calls
from multiserve.parsing.scanning import find_markers

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        return find_markers(text, (START,))

    def _take(self, text: str, final: bool) -> Taken:
        end = text.find(END, len(START))
        if end == -1:
            if not final:
                return None
            return len(text), loads_calls(text[len(START):])  # ended without the close tag
        return end + len(END), loads_calls(text[len(START):end])
