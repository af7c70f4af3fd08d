"""`Grammar`: a compiled decoding constraint, as a request carries it.

Invariants:
- Equality and hash are those of (kind, source): `source` is the canonical llguidance
  grammar text (the compile cache's key), so `SamplingParams` stays hashable and two
  requests with the same constraint compare equal.
- `template` is a matcher in its initial state, built (validated) once by
  `GrammarCompiler`; it is never advanced: every sample takes `new_matcher()`, a deep copy.
- `vocab_size` is the width (in tokens) of the masks the matchers fill: the engine's
  logits width, or more (then the engine keeps the first logits-width tokens of a mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag",
                 "tool_call")


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of GRAMMAR_KINDS (what the client asked for)
    source: str  # the llguidance grammar text compiled
    vocab_size: int
    template: Any = field(default=None, compare=False, hash=False, repr=False)

    def new_matcher(self) -> Any:
        """A fresh llguidance LLMatcher in the grammar's start state."""
        if self.template is None:
            raise ValueError("grammar: not compiled (build it with GrammarCompiler)")
        return self.template.deep_copy()

    @property
    def mask_words(self) -> int:
        """int32 words of one packed mask row."""
        return (self.vocab_size + 31) // 32
