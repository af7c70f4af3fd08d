"""Incremental detokenization of one sample: text deltas safe to send to a client.

Owns: `IncrementalDetokenizer`, which turns a growing list of output token ids into
text deltas. It never DECIDES a stop string: the engine does, in one place
(engine/base/stop_strings.py), and finishes the sample on the token that completed it; this
class only presents that decision.

Invariants:
- Text is emitted only once it is final: a decode window that ends in the Unicode
  replacement character (an incomplete multi-byte character) is held back until the
  next token completes it (or the sample ends).
- Text that could still be the start of a stop string, or is one, is held back until
  the next token or the end disambiguates it, so a stop string is never streamed out
  before the engine's verdict. At `finish(matched_stop)`, the text from the engine's matched stop
  string on is dropped (kept with `no_stop_trim`, as sglang does).
- The concatenation of all returned deltas equals `text` (the emitted text).
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
        assert not self.finished, "sample already ended"
        self._ids.append(int(token_id))
        self.num_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return self._append(new_text[len(prefix_text):])
        return ""

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def finish(self, matched_stop: str | None = None) -> str:
        """The sample ended; flush everything still held. `matched_stop`: the stop string
        the engine finished it on; the text from its occurrence on is dropped (unless
        no_stop_trim). The occurrence lies in the held-back tail (the engine stops on the
        token that completes it, and a stop's beginning is held until then); if this
        sample's text does not contain it (skip_special_tokens removed a special token
        inside it), nothing is dropped."""
        if self.finished:
            return ""
        self.finished = True
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        self._confirmed += new_text[len(prefix_text):]
        if matched_stop and not self.no_stop_trim:
            at = self._confirmed.find(matched_stop, self._emitted)
            if at != -1:
                self._confirmed = self._confirmed[:at]
        out = self._confirmed[self._emitted:]
        self._emitted = len(self._confirmed)
        return out

    def _append(self, piece: str) -> str:
        self._confirmed += piece
        end = max(self._held_from(), self._emitted)
        out = self._confirmed[self._emitted:end]
        self._emitted = end
        return out

    def _held_from(self) -> int:
        """Where the held-back tail starts: at the earliest whole stop string not yet
        emitted (the engine finishes the sample on it: `finish` drops it; a whole one
        can only precede the end when a chunk of several tokens arrives at once), else
        at the longest suffix that could still become one."""
        text = self._confirmed
        if not self.stop:
            return len(text)
        found = [i for i in (text.find(s, self._emitted) for s in self.stop) if i != -1]
        if found:
            return min(found)
        return len(text) - self._partial_stop_len()

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        text = self._confirmed
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
