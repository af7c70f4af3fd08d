"""Incremental detokenization of one sample, with stop strings.

Owns: `IncrementalDetokenizer`, which turns a growing list of output token ids into
text deltas that are safe to send to a client.

Invariants:
- Text is emitted only once it is final: a decode window that ends in the Unicode
  replacement character (an incomplete multi-byte character) is held back until the
  next token completes it (or the sample ends).
- Stop strings: the output stops at the EARLIEST match of any stop string; the stop
  string and everything after it are never emitted (unless `no_stop_trim`: then the text
  decoded so far, stop string included, is kept, as sglang does). Text that could still
  be the start of a stop string is held back until it is disambiguated.
- The concatenation of all returned deltas equals `text` (the emitted text).
- `num_tokens` counts the output tokens consumed, up to and including the token that
  completed a stop string; tokens offered after the stop are refused by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context so tokenizers that strip a leading space when
# decoding a sequence start (sentencepiece) still produce the right first piece.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Detokenizes one sample token by token. Not thread-safe; one per sample."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, prompt_ids: Sequence[int] = (),
                 no_stop_trim: bool = False) -> None:
        self._tok = tokenizer
        self.no_stop_trim = no_stop_trim
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]]
        # Decode window: ids[_prefix:_read] is already turned into text; ids[_read:] not yet.
        self._prefix = len(self._ids)
        self._read = len(self._ids)
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._confirmed = ""  # final text so far (some of it may be held for stop strings)
        self._emitted = 0  # length of the prefix of _confirmed already returned
        self.num_tokens = 0
        self.stopped = False
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._confirmed[:self._emitted]

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(list(ids), skip_special_tokens=self._skip,
                                clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        """Consume one output token; return the newly emittable text (maybe "")."""
        assert not self.stopped and not self.finished, "sample already ended"
        self._ids.append(int(token_id))
        self.num_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return self._append(new_text[len(prefix_text):])
        return ""

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consume tokens until they run out or a stop string matches."""
        out = []
        for t in token_ids:
            if self.stopped:
                break
            out.append(self.add_token(t))
        return "".join(out)

    def finish(self) -> str:
        """The sample ended (not by a stop string): flush everything still held."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        out = self._append(new_text[len(prefix_text):])
        if not self.stopped:
            out += self._confirmed[self._emitted:]
            self._emitted = len(self._confirmed)
        return out

    def _append(self, piece: str) -> str:
        old_len = len(self._confirmed)
        self._confirmed += piece
        hold = 0
        if self.stop:
            cut, which = self._earliest_stop(old_len)
            if which is not None:
                if not self.no_stop_trim:
                    self._confirmed = self._confirmed[:cut]
                self.stopped = True
                self.matched_stop = which
                out = self._confirmed[self._emitted:]
                self._emitted = len(self._confirmed)
                return out
            hold = self._partial_stop_len()
        end = max(len(self._confirmed) - hold, self._emitted)
        out = self._confirmed[self._emitted:end]
        self._emitted = end
        return out

    def _earliest_stop(self, old_len: int) -> tuple[int, str | None]:
        # Matches wholly inside the old text were found before; only look where a
        # match could end in the new piece.
        best, which = len(self._confirmed) + 1, None
        for s in self.stop:
            i = self._confirmed.find(s, max(0, old_len - len(s) + 1))
            if i != -1 and i < best:
                best, which = i, s
        return best, which

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        text = self._confirmed
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
