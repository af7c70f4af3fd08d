"""Stop strings: the one place that decides whether a sample stopped on one (no jax).

The engine core asks after every new output token; the sample finishes ("stop") on the
token that completes a stop string, with that string as `matched_stop`. Everything
downstream (the HTTP detokenizer's trimming, the in-process text) follows this verdict and
never searches for stop strings on its own.

Invariants:
- The decoded tail covers every stop string that could have been completed by the newest
  token (a stop of L characters spans at most L tokens; the window adds a margin for
  tokens that decode to nothing).
- When several stop strings are present, the one that starts earliest wins (it is where
  the text ends); ties go to the order the client gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WINDOW_MARGIN_TOKENS = 8


class StopStringChecker:
    """Decides stop strings for one engine, with the engine's one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, output_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        """The stop string the output ends on now, or None."""
        window = max(len(s) for s in stops) + WINDOW_MARGIN_TOKENS
        text = self._tokenizer.decode(list(output_ids[-window:]), skip_special_tokens=False)
        found = [(at, k) for k, s in enumerate(stops) if s and (at := text.find(s)) != -1]
        return stops[min(found)[1]] if found else None
