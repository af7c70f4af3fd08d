"""The tool-call parser base: one streaming engine that every format plugs into.

Owns: `ToolCallParser` — `feed(delta)` / `flush()` for streaming and `parse(text)` (the
same engine fed once), so a text split anywhere streams out exactly what the
non-streaming parse returns. A format supplies two hooks over the text not consumed yet:
`_find_start` (where a call may begin) and `_take` (one call region, once complete).

Invariants:
- Nothing of a call reaches the normal text: text that may still be the start of a call
  is held back until more text (or the end) decides.
- A region that is not a valid call is given back as normal text, verbatim.
- Whitespace around calls is dropped: trailing whitespace of the normal text is held
  until non-space text follows (emitted) or a call follows (dropped); text right after a
  call loses its leading whitespace; at the end, held whitespace is emitted only if no
  call was found.
- Calls to a tool not in `tools` (when tools are given) are dropped, as SGLang does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from multiserve.parsing.types import ToolCall, ToolCallDelta, ToolStreamResult

log = logging.getLogger("multiserve.parsing")

# A parsed call before canonicalisation: (name, arguments object or JSON text).
RawCall = tuple[str, Any]
# `_take`'s answer: None (need more text), (n, calls) or (n, None): text[:n] is no call.
Taken = tuple[int, list[RawCall] | None] | None


def tool_name(tool: Any) -> str | None:
    """The function name of an OpenAI tool (dict or pydantic model), if any."""
    if hasattr(tool, "model_dump"):
        tool = tool.model_dump()
    if not isinstance(tool, Mapping):
        return None
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) and name else None


def tool_schema(tool: Any) -> Mapping[str, Any]:
    """The parameters JSON schema of an OpenAI tool ({} if none)."""
    if hasattr(tool, "model_dump"):
        tool = tool.model_dump()
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
    params = fn.get("parameters") if isinstance(fn, Mapping) else None
    return params if isinstance(params, Mapping) else {}


class ToolCallParser:
    """Base of every tool-call format. One instance parses one output (not thread-safe)."""

    name: ClassVar[str] = ""

    def __init__(self, tools: Sequence[Any] | None = None) -> None:
        self.tools: list[Any] = list(tools) if tools is not None else []
        self._indices: dict[str, int] | None = None
        if tools is not None:
            self._indices = {}
            for i, t in enumerate(self.tools):
                n = tool_name(t)
                if n is not None and n not in self._indices:
                    self._indices[n] = i
        self._buf = ""
        self._in_region = False  # _buf starts at a definite call start
        self._held_ws = ""
        self._after_call = False
        self.emitted_text = False  # some normal text was emitted
        self.calls: list[ToolCall] = []  # every call found so far, in order
        self._finished = False

    # ---- format hooks -------------------------------------------------------------
    def _find_start(self, text: str, final: bool) -> tuple[int, int]:
        """(index of the first definite call start or -1, index from which text must be
        held back because it may still become a start; == start when start >= 0)."""
        raise NotImplementedError

    def _take(self, text: str, final: bool) -> Taken:
        """`text` begins at a call start. None: the region is not complete yet (never when
        `final`); (n, calls): text[:n] is these calls; (n, None): text[:n] is no call."""
        raise NotImplementedError

    # ---- public API -------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streaming: (normal text, calls). A fresh parser per call."""
        first = self.feed(text)
        last = self.flush()
        return first.normal_text + last.normal_text, list(self.calls)

    def feed(self, delta: str) -> ToolStreamResult:
        assert not self._finished, "flush() was called: this parser is done"
        self._buf += delta
        return self._process(final=False)

    def flush(self) -> ToolStreamResult:
        """The output ended: everything still held is decided and returned."""
        if self._finished:
            return ToolStreamResult()
        out = self._process(final=True)
        self._finished = True
        return out

    # ---- engine ---------------------------------------------------------------------
    def _process(self, final: bool) -> ToolStreamResult:
        out = ToolStreamResult()
        text_parts: list[str] = []
        while self._buf:
            if self._in_region:
                taken = self._take(self._buf, final)
                if taken is None:
                    assert not final, f"{type(self).__name__}._take asked for more at the end"
                    break
                n, raw = taken
                assert n > 0, "a region consumes at least one character"
                region, self._buf = self._buf[:n], self._buf[n:]
                self._in_region = False
                calls = self._accept(raw) if raw is not None else None
                if calls is None:
                    self._emit_text(region, text_parts)
                else:
                    self._held_ws = ""  # whitespace before a call is dropped
                    self._after_call = True
                    out.calls.extend(calls)
                continue
            start, hold = self._find_start(self._buf, final)
            if start >= 0:
                self._emit_text(self._buf[:start], text_parts)
                self._buf = self._buf[start:]
                self._in_region = True
                continue
            cut = len(self._buf) if final else hold
            self._emit_text(self._buf[:cut], text_parts)
            self._buf = self._buf[cut:]
            break
        if final and self._held_ws and not self.calls:
            text_parts.append(self._held_ws)
        if final:
            self._held_ws = ""
        out.normal_text = "".join(text_parts)
        return out

    def _emit_text(self, text: str, parts: list[str]) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
        text = self._held_ws + text
        core = text.rstrip()
        self._held_ws = text[len(core):]
        if core:
            parts.append(core)
            self._after_call = False
            self.emitted_text = True

    def _accept(self, raw: list[RawCall]) -> list[ToolCallDelta] | None:
        """Canonical deltas for parsed calls (unknown tools dropped); None if a call's
        arguments are not a JSON object (the region is then normal text)."""
        canon: list[tuple[str, str]] = []
        for name, args in raw:
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    return None
            if args is None:
                args = {}
            if not isinstance(args, dict) or not isinstance(name, str) or not name:
                return None
            canon.append((name, json.dumps(args, ensure_ascii=False)))
        deltas: list[ToolCallDelta] = []
        for name, params in canon:
            if self._indices is not None and name not in self._indices:
                log.warning("model called an undefined tool %r: dropped", name[:80])
                continue
            index = len(self.calls)
            tool_index = -1 if self._indices is None else self._indices[name]
            self.calls.append(ToolCall(tool_index, name, params))
            deltas.append(ToolCallDelta(index, name, ""))
            deltas.append(ToolCallDelta(index, None, params))
        return deltas
