"""Qwen3-Coder XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by its type in the tool's JSON schema
(integer, number, boolean, object, array, null: parsed as JSON, kept as text if that
fails; string or unknown: the text). One newline after the opening tag and before the
closing tag is part of the format, not of the value."""

from __future__ import annotations

import json
import re
from typing import Any

from multiserve.parsing.base import RawCall, Taken, ToolCallParser, tool_name, tool_schema
from multiserve.parsing.scanning import find_markers

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_NON_STRING = ("integer", "number", "boolean", "object", "array", "null")


def _value(raw: str, schema: Any) -> Any:
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if not any(k in _NON_STRING for k in kinds):
        return raw
    text = raw.strip()
    if "boolean" in kinds and text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return raw


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"

    def _properties(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if tool_name(t) == name:
                props = tool_schema(t).get("properties")
                return dict(props) if isinstance(props, dict) else {}
        return {}

    def _calls(self, body: str) -> list[RawCall] | None:
        out: list[RawCall] = []
        pos = 0
        for m in _FUNC.finditer(body):
            if body[pos:m.start()].strip():
                return None
            pos = m.end()
            name = m.group(1).strip()
            props = self._properties(name)
            args = {p.group(1).strip(): _value(p.group(2), props.get(p.group(1).strip()))
                    for p in _PARAM.finditer(m.group(2))}
            out.append((name, args))
        if body[pos:].strip():
            return None
        return out or None

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        return find_markers(text, (START, FUNC))

    def _take(self, text: str, final: bool) -> Taken:
        wrapped = text.startswith(START)
        close = END if wrapped else FUNC_END
        begin = len(START) if wrapped else 0
        end = text.find(close, begin)
        if end == -1:
            return None if not final else (len(text), self._calls(text[begin:]))
        body = text[begin:end] if wrapped else text[:end + len(close)]
        return end + len(close), self._calls(body)
