"""DeepSeek-V3 tool calls:
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
(the V3.1 form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` is read too)."""

from __future__ import annotations

import re

from multiserve.parsing.base import RawCall, Taken, ToolCallParser
from multiserve.parsing.scanning import find_markers

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3 = re.compile(r"\s*function\s*" + re.escape(SEP) + r"(?P<name>[^\n]+)\n```(?:json)?\n"
                 r"(?P<args>.*)\n```\s*", re.DOTALL)
_V31 = re.compile(r"\s*(?P<name>[^\n<]+?)\s*" + re.escape(SEP) + r"(?P<args>.*)", re.DOTALL)


def _calls(body: str) -> list[RawCall] | None:
    out: list[RawCall] = []
    rest = body.strip()
    while rest:
        if not rest.startswith(CALL_BEGIN):
            return None
        end = rest.find(CALL_END)
        inner = rest[len(CALL_BEGIN):end if end != -1 else len(rest)]
        m = _V3.fullmatch(inner) or _V31.fullmatch(inner)
        if m is None:
            return None
        out.append((m.group("name").strip(), m.group("args").strip()))
        rest = "" if end == -1 else rest[end + len(CALL_END):].strip()
    return out or None


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseekv3"

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        return find_markers(text, (CALLS_BEGIN,))

    def _take(self, text: str, final: bool) -> Taken:
        end = text.find(CALLS_END)
        if end == -1:
            return None if not final else (len(text), _calls(text[len(CALLS_BEGIN):]))
        return end + len(CALLS_END), _calls(text[len(CALLS_BEGIN):end])
