"""Reasoning parsers: `<think>...</think>` split from the answer, on text.

`qwen3`: the reply reasons only if it opens with `<think>` (after optional whitespace).
`deepseek-r1`: the template writes `<think>` into the prompt, so the reply starts inside
the reasoning (an opening `<think>` the model writes anyway is dropped); a reply without
`</think>` is all reasoning.

Invariants: `feed` + `flush` over any split of a text give what `parse` gives for the
whole; a partial `<think>` / `</think>` is held back until decided; the reasoning text
and the answer that follows it are stripped of surrounding whitespace (a reply that
never reasons passes through unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from multiserve.parsing.scanning import partial_marker_at

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning_text: str = ""
    normal_text: str = ""


class _Trimmed:
    """A text stream with leading whitespace dropped and trailing whitespace held until
    more text follows (dropped at the end)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        core = text.rstrip()
        self._held = text[len(core):]
        return core


class ReasoningParser:
    """One output's reasoning split (not thread-safe). `name`: a REASONING_PARSERS key."""

    force_reasoning: ClassVar[bool] = False
    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start (undecided) | reasoning | normal | plain (no reasoning)
        self._reasoning = _Trimmed()
        self._normal = _Trimmed()
        self._finished = False

    def parse(self, text: str) -> tuple[str, str]:
        """Non-streaming: (reasoning text, normal text)."""
        a, b = self.feed(text), self.flush()
        return a.reasoning_text + b.reasoning_text, a.normal_text + b.normal_text

    def feed(self, delta: str) -> ReasoningDelta:
        assert not self._finished, "flush() was called: this parser is done"
        self._buf += delta
        return self._process(final=False)

    def flush(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        out = self._process(final=True)
        self._finished = True
        return out

    def _process(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf = head[len(THINK_START):]
                self._mode = "reasoning"
            elif THINK_START.startswith(head) and not final:
                return out  # empty or a partial tag: undecided
            else:
                self._mode = "reasoning" if self.force_reasoning else "plain"
        if self._mode == "plain":
            out.normal_text, self._buf = self._buf, ""
            return out
        if self._mode == "reasoning":
            end = self._buf.find(THINK_END)
            if end != -1:
                out.reasoning_text = self._reasoning.add(self._buf[:end])
                self._buf = self._buf[end + len(THINK_END):]
                self._mode = "normal"
            else:
                cut = len(self._buf) if final else partial_marker_at(self._buf, (THINK_END,))
                out.reasoning_text = self._reasoning.add(self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
        out.normal_text, self._buf = self._normal.add(self._buf), ""
        return out


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    force_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek-r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser; KeyError naming the known ones if `name` is unknown."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise KeyError(f"unknown reasoning parser {name!r}; known: "
                       f"{', '.join(sorted(REASONING_PARSERS))}")
    return cls()
