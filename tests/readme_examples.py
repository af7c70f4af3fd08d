"""The README's first examples as the tests run them (tests/engine/test_determinism.py: the
in-process `Engine`; tests/server/test_structured_default.py: curl and the openai client),
on the suite's default-model engine and server instead of a new engine or the fleet's
ports: the code is the README's, only the engine or the address is the test's."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(lang: str, containing: str) -> str:
    """The README's first fenced `lang` block that contains `containing`."""
    fence = re.compile("^```" + re.escape(lang) + r"\n(.*?)^```", re.M | re.S)
    blocks = fence.findall(README.read_text())
    found = [b for b in blocks if containing in b]
    assert found, f"README.md has no ```{lang} block containing {containing!r}"
    return found[0]
