"""Pythonic tool calls (Llama 3.2 / 3.3 / 4 pythonic templates): a Python list of calls
with keyword arguments whose values are literals, e.g.
`[get_weather(city="Paris", days=3), get_time(zone="CET")]`, optionally wrapped in
`<|python_start|>` ... `<|python_end|>` (Llama 4)."""

from __future__ import annotations

import ast
import re

from multiserve.parsing.base import RawCall, Taken, ToolCallParser
from multiserve.parsing.scanning import INCOMPLETE, value_end

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# a suffix that may still grow into a start: `[`, `[ name`, `[ name ` (or a partial tag)
_MAYBE = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _calls(source: str) -> list[RawCall] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out: list[RawCall] = []
    for call in tree.body.elts:
        if not isinstance(call, ast.Call) or call.args:
            return None
        name = _dotted(call.func)
        if name is None or any(k.arg is None for k in call.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        out.append((name, args))
    return out


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        tag = text.find(PY_START)
        m = _START.search(text)
        starts = [i for i in (tag, m.start() if m else -1) if i != -1]
        if starts:
            return min(starts), min(starts)
        hold = len(text)
        maybe = _MAYBE.search(text)
        if maybe:
            hold = maybe.start()
        for k in range(min(len(PY_START) - 1, len(text)), 0, -1):
            if PY_START.startswith(text[-k:]):
                hold = min(hold, len(text) - k)
                break
        return -1, hold

    def _take(self, text: str, final: bool) -> Taken:
        if text.startswith(PY_START):
            end = text.find(PY_END)
            if end == -1:
                return None if not final else (len(text), None)
            return end + len(PY_END), _calls(text[len(PY_START):end])
        end = value_end(text, 0, python=True)
        if end == INCOMPLETE:
            return None if not final else (len(text), None)
        return end, _calls(text[:end])
