"""Llama 3.1 / 3.2 JSON tool calls: `<|python_tag|>{"name": ..., "parameters": {...}}`, or the
bare JSON object as the whole reply; several calls separated by `;`."""

from __future__ import annotations

from multiserve.parsing.base import Taken, ToolCallParser
from multiserve.parsing.json_call import loads_calls
from multiserve.parsing.scanning import INCOMPLETE, find_markers, value_end

TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    name = "llama3"

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not self.emitted_text:
            # a reply that is a JSON object (or, after a call, `; {...}`) is a call region
            if not stripped:
                return -1, 0
            if stripped[0] == "{" or (self.calls and stripped[0] == ";"):
                return lead, lead
        return find_markers(text, (TAG,))

    def _take(self, text: str, final: bool) -> Taken:
        i = len(TAG) if text.startswith(TAG) else 0
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= len(text):
            return None if not final else (len(text), None)
        if text[i] != "{":
            return i if i > 0 else 1, None
        end = value_end(text, i)
        if end == INCOMPLETE:
            return None if not final else (len(text), None)
        return end, loads_calls(text[i:end])
