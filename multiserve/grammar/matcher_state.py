"""`GrammarState`: one sample's grammar matcher inside the engine.

Invariants:
- The matcher has consumed exactly `output_ids[:consumed]` of its sample; `sync()` makes
  that the whole output (replaying from a fresh matcher when it is not a prefix walk:
  after a retract, a restart or a resubmitted request the state is rebuilt from the
  emitted tokens alone, so constrained outputs are the same whatever happened between).
- `fill(row)` writes the packed allowed-token mask (bit t of word t // 32 set = token t
  allowed) of the NEXT token into an int32 row; it is called only when `sync()` is current.
- A rejected token (`advance` returns False) puts the matcher in its error state for good;
  the engine then ends the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from multiserve.grammar.grammar import Grammar


class GrammarState:
    def __init__(self, grammar: Grammar, resumed: Sequence[int] = ()) -> None:
        """`resumed`: tokens generated under this grammar before (a resubmitted request's
        partial output, now the end of its prompt): replayed first, every time."""
        self.grammar = grammar
        self.resumed = [int(t) for t in resumed]
        self.matcher: Any = self._fresh()
        self.consumed = 0

    def _fresh(self) -> Any:
        matcher = self.grammar.new_matcher()
        if self.resumed:
            matcher.consume_tokens(self.resumed)
        return matcher

    def sync(self, output_ids: Sequence[int]) -> bool:
        """Bring the matcher to the end of `output_ids`; False if some token is rejected."""
        n = len(output_ids)
        if n < self.consumed:
            self.matcher = self._fresh()
            self.consumed = 0
        if n > self.consumed:
            ok = self.matcher.consume_tokens([int(t) for t in output_ids[self.consumed:n]])
            self.consumed = n
            return bool(ok) and not self.matcher.is_error()
        return not self.matcher.is_error()

    def advance(self, token: int) -> bool:
        """Consume one emitted token; False if the grammar rejects it."""
        self.consumed += 1
        return bool(self.matcher.consume_token(int(token))) and not self.matcher.is_error()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS remains allowed)."""
        return bool(self.matcher.is_stopped())

    @property
    def failed(self) -> bool:
        """The matcher is in its error state (a token, or the resumed output, rejected)."""
        return bool(self.matcher.is_error())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's allowed mask into `row` (int32[W], C-contiguous, W the
        engine's mask width; a wider grammar mask is cut to W words)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"], row.dtype
        words = self.grammar.mask_words
        if words == row.size:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
            return
        full = np.zeros(max(words, row.size), np.int32)
        self.matcher.unsafe_compute_mask_ptr(full.ctypes.data, words * 4)
        row[:] = full[:row.size]
