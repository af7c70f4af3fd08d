"""Value types shared by the tool-call and reasoning parsers (plain data, no jax).

Invariants: `ToolCall.parameters` and `ToolCallDelta.arguments` are JSON text (a
parsed call's arguments object, `json.dumps(..., ensure_ascii=False)`); a call's
streamed deltas are one with its `name` (and empty arguments) then one with all its
argument text, so their concatenated arguments equal the non-streaming `parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `tool_index`: the position of the tool in the `tools` given to
    the parser (-1 when the parser was given no tools); `parameters`: JSON text."""

    tool_index: int
    name: str
    parameters: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of a call. `index`: the call's ordinal in this output (0, 1, ...);
    `name` is set on the call's first delta only; `arguments` is argument JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolStreamResult:
    """What one `feed` / `flush` of a streaming tool parser gives: normal text never holds
    any part of a call."""

    normal_text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
