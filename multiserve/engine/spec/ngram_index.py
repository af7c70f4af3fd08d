"""NgramIndex: for a growing token sequence, where each recent n-gram last occurred with
at least one token after it, so that the tokens which followed it can be proposed.

Invariants: `_last[n][g]` is the end (exclusive) of the latest occurrence of n-gram `g`
that has a following token in `tokens`; the sequence's own final n-gram is never its own
match (it has no following token yet). A `SEPARATOR` token (-1) ends a segment: no n-gram
spans it and no continuation runs past it. Plain Python, no jax.
"""

from __future__ import annotations

from collections.abc import Iterable

SEPARATOR = -1


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        toks = self.tokens
        for tok in new:
            end = len(toks)  # the n-grams ending here gain `tok` as their continuation
            if tok != SEPARATOR:
                for n, table in self._last.items():
                    if end >= n:
                        gram = tuple(toks[end - n:end])
                        if SEPARATOR not in gram:
                            table[gram] = end
            toks.append(tok)

    def propose(self, context: list[int], k: int) -> tuple[int, tuple[int, ...]]:
        """(n, up to k tokens) that followed the latest earlier occurrence of the longest
        n-gram ending `context` (n from max_n down to min_n); (0, ()) if none matches."""
        if k <= 0:
            return 0, ()
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) < n:
                continue
            end = self._last[n].get(tuple(context[-n:]))
            if end is None:
                continue
            cont = self.tokens[end:end + k]
            if SEPARATOR in cont:
                cont = cont[:cont.index(SEPARATOR)]
            if cont:
                return n, tuple(cont)
        return 0, ()

    def approx_bytes(self) -> int:
        """A rough size in memory: the token list plus one table entry per stored n-gram."""
        entries = sum(len(t) for t in self._last.values())
        return 8 * len(self.tokens) + entries * (64 + 8 * self.max_n)
