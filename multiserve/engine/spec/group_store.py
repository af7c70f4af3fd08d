"""GroupStore: a shared, bounded index of the outputs already produced for each prompt,
so that the samples of a GRPO group and the rollouts of the same prompt in later epochs
draft from their siblings' and predecessors' continuations.

Keyed by the prompt's token ids (hashed with the ids kept for an exact check). Each finished
sample adds `prompt[-tail:] + output` as one segment (the prompt's tail lets a sample's
first tokens match). Least recently used prompts are dropped once the estimated bytes
exceed `max_bytes`. Plain Python, no jax; owned by the engine thread (one writer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from multiserve.engine.spec.ngram_index import SEPARATOR, NgramIndex


class GroupStore:
    def __init__(self, max_bytes: int = 64 << 20, min_n: int = 2, max_n: int = 4) -> None:
        self.max_bytes = max_bytes
        self.min_n, self.max_n = min_n, max_n
        self._by_prompt: OrderedDict[tuple[int, ...], NgramIndex] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._by_prompt)

    @property
    def approx_bytes(self) -> int:
        return self._bytes

    def index_for(self, prompt: Sequence[int]) -> NgramIndex | None:
        key = tuple(prompt)
        index = self._by_prompt.get(key)
        if index is not None:
            self._by_prompt.move_to_end(key)
        return index

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        if not output:
            return
        key = tuple(prompt)
        index = self._by_prompt.pop(key, None)
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
        else:
            self._bytes -= index.approx_bytes()
        index.extend([*prompt[-self.max_n:], *output, SEPARATOR])
        self._by_prompt[key] = index
        self._bytes += index.approx_bytes()
        while self._bytes > self.max_bytes and len(self._by_prompt) > 1:
            _, old = self._by_prompt.popitem(last=False)
            self._bytes -= old.approx_bytes()
        if self._bytes > self.max_bytes:  # one prompt alone is over the cap
            self._by_prompt.clear()
            self._bytes = 0

    def clear(self) -> None:
        self._by_prompt.clear()
        self._bytes = 0
