"""Finding where a bracketed JSON or Python value ends in text that may still grow.

Invariant: `value_end` answers from the text alone, so the same text gives the same
answer however it arrived (what makes streaming parses split-invariant).
"""

from __future__ import annotations

_CLOSE = {"{": "}", "[": "]", "(": ")"}
INCOMPLETE = -1


def value_end(text: str, i: int, *, python: bool = False) -> int:
    """Index just past the bracketed value starting at text[i] ('{', '[' or '('), or
    INCOMPLETE if the text ends inside it. Strings are skipped (double quotes; single
    quotes too when `python`), with backslash escapes; mismatched closers end the scan
    at that character (the caller's parse then rejects the value)."""
    assert text[i] in _CLOSE
    stack: list[str] = []
    quote: str | None = None
    j = i
    n = len(text)
    while j < n:
        c = text[j]
        if quote is not None:
            if c == "\\":
                j += 2
                continue
            if c == quote:
                quote = None
        elif c == '"' or (python and c == "'"):
            quote = c
        elif c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                return j + 1
            if not stack:
                return j + 1
        j += 1
    return INCOMPLETE


def partial_marker_at(text: str, markers: tuple[str, ...]) -> int:
    """The start of the longest suffix of `text` that is a proper prefix of a marker
    (text to hold back, it may still become one), or len(text) if none."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if m.startswith(text[-k:]):
                longest = k
                break
    return len(text) - longest


def find_markers(text: str, markers: tuple[str, ...]) -> tuple[int, int]:
    """(start of the first whole marker or -1, where text to hold back starts)."""
    found = [i for i in (text.find(m) for m in markers) if i != -1]
    if found:
        start = min(found)
        return start, start
    return -1, partial_marker_at(text, markers)
