"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers)
or `[TOOL_CALLS]name[ARGS]{...}` (v11+, optionally `[CALL_ID]id` before `[ARGS]`)."""

from __future__ import annotations

import re

from multiserve.parsing.base import Taken, ToolCallParser
from multiserve.parsing.json_call import loads_calls
from multiserve.parsing.scanning import INCOMPLETE, find_markers, value_end

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolCallParser):
    name = "mistral"

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        return find_markers(text, (TAG,))

    def _take(self, text: str, final: bool) -> Taken:
        i = len(TAG)
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return None if not final else (len(text), None)
        if text[i] == "[":  # a JSON list of calls
            end = value_end(text, i)
            if end == INCOMPLETE:
                return None if not final else (len(text), None)
            return end, loads_calls(text[i:end])
        at = text.find(ARGS, i)
        if at == -1:
            return None if not final else (len(text), None)
        head = text[i:at]
        name = head.split(CALL_ID, 1)[0]
        j = at + len(ARGS)
        while j < len(text) and text[j].isspace():
            j += 1
        if not _NAME.fullmatch(name) or (j < len(text) and text[j] != "{"):
            return at + len(ARGS), None
        if j >= len(text):
            return None if not final else (len(text), None)
        end = value_end(text, j)
        if end == INCOMPLETE:
            return None if not final else (len(text), None)
        return end, [(name, text[j:end])]
