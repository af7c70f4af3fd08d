"""The parsers on token ids, for RL callers that hold a model's output as ids (what
`/generate` returns as `output_ids`): the ids are decoded by the caller's tokenizer (or
any `ids -> text` callable) and the text parsers run on the result.

    normal, calls = parse_tool_call_ids(ids, tokenizer, "hermes", tools)
    reasoning, answer = separate_reasoning_ids(ids, tokenizer, "qwen3")

Streaming: `IncrementalDecoder(tokenizer).feed(new_ids)` gives each step's new text for a
parser's `feed`; its `flush()` gives what it held.

Invariants: ids decode as the caller's tokenizer decodes them, special tokens skipped
unless `skip_special_tokens=False` (a tokenizer whose call markers are special tokens
needs False); the incremental decoder's pieces concatenate to the decode of all ids
for a tokenizer whose decode of a prefix is a prefix of the whole's (byte-level BPE, the
default model's: a piece ending in an incomplete UTF-8 sequence, U+FFFD, is held until the next ids
complete it, or until `flush()`). Plain Python: no jax, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from multiserve.parsing.reasoning import reasoning_parser
from multiserve.parsing.registry import tool_call_parser
from multiserve.parsing.types import ToolCall

Decode = Callable[[Sequence[int]], str]


def as_decode(tokenizer: Any, skip_special_tokens: bool = True) -> Decode:
    """An `ids -> text` callable: `tokenizer` itself if it is one (a plain callable with
    no `decode`), else its `decode(ids, skip_special_tokens=...)`."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        if not callable(tokenizer):
            raise TypeError("give a tokenizer with decode(ids) or an ids -> text callable")
        return tokenizer
    return lambda ids: decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)


def parse_tool_call_ids(ids: Sequence[int], tokenizer: Any, parser: str = "hermes",
                        tools: Sequence[Any] | None = None,
                        skip_special_tokens: bool = True) -> tuple[str, list[ToolCall]]:
    """(normal text, calls) of an output given as token ids."""
    text = as_decode(tokenizer, skip_special_tokens)(ids)
    return tool_call_parser(parser, tools).parse(text)


def separate_reasoning_ids(ids: Sequence[int], tokenizer: Any, parser: str = "qwen3",
                           skip_special_tokens: bool = True) -> tuple[str, str]:
    """(reasoning text, normal text) of an output given as token ids."""
    text = as_decode(tokenizer, skip_special_tokens)(ids)
    return reasoning_parser(parser).parse(text)


class IncrementalDecoder:
    """Text deltas of a growing id sequence (one output; not thread-safe)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._decode = as_decode(tokenizer, skip_special_tokens)
        self.ids: list[int] = []
        self._sent = 0  # characters of decode(ids) already returned

    def feed(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the ids that finish it
        return self._take(text)

    def flush(self) -> str:
        return self._take(self._decode(self.ids))

    def _take(self, text: str) -> str:
        out = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return out
