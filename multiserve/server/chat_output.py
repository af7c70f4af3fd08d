"""A chat reply's text split into reasoning, content and tool calls (one per sample).

Owns: `ChatOutputParser` — the reasoning parser (when set and `separate_reasoning`) first,
then the tool-call parser on what follows the reasoning (when the request has tools and
tool_choice is not "none"); `feed(text)` per streamed delta, `flush()` at the end. The
non-streaming reply is `feed(whole)` + `flush()`, so it equals the stream's sum.

Invariants: with `parallel_tool_calls` false only the first call is kept (later ones are
dropped, never turned into content); each call gets one id (`call_<24 hex>`, as SGLang),
sent on its first delta.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from multiserve.parsing import ToolCallDelta, ToolCallParser, reasoning_parser, tool_call_parser
from multiserve.parsing.reasoning import ReasoningParser


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ChatPiece) -> ChatPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)
        return self


class ChatOutputParser:
    def __init__(self, reasoning: str | None, tool_parser: str | None,
                 tools: Sequence[Any] | None, parallel_tool_calls: bool = True,
                 stream_reasoning: bool = True) -> None:
        self._reasoning: ReasoningParser | None = (
            reasoning_parser(reasoning) if reasoning else None)
        self._tools: ToolCallParser | None = (
            tool_call_parser(tool_parser, tools) if tool_parser else None)
        self._parallel = parallel_tool_calls
        self._stream_reasoning = stream_reasoning
        self._held_reasoning = ""
        self.ids: dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> ChatPiece:
        return self._step(text, final=False)

    def flush(self) -> ChatPiece:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ChatPiece:
        piece = ChatPiece()
        normal = text
        if self._reasoning is not None:
            r = self._reasoning.flush() if final else self._reasoning.feed(text)
            piece.reasoning, normal = r.reasoning_text, r.normal_text
            if not self._stream_reasoning:
                self._held_reasoning += piece.reasoning
                piece.reasoning = ""
                if normal or final:
                    piece.reasoning, self._held_reasoning = self._held_reasoning, ""
        if self._tools is None:
            piece.content = normal
            return piece
        out = self._tools.feed(normal) if normal else None
        last = self._tools.flush() if final else None
        for res in (out, last):
            if res is None:
                continue
            piece.content += res.normal_text
            for d in res.calls:
                if d.index > 0 and not self._parallel:
                    continue
                if d.index not in self.ids:
                    self.ids[d.index] = f"call_{uuid.uuid4().hex[:24]}"
                piece.calls.append(d)
        return piece
