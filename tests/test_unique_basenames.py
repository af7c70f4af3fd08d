"""Every test module and helper under tests/ has a basename of its own: the suite imports
them by basename from their directories (rootdir imports, no __init__.py), so two files of
one name make collection fail ("import file mismatch") in whichever process meets both."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_module_under_tests_has_a_unique_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts and path.name != "conftest.py":
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"modules sharing a basename: {clashes}"
