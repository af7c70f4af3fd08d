"""Typed commands, one dispatch (issue 12): every command type of engine/commands.py has
exactly one case in `Engine._dispatch` (Stop is the loop's own), and nothing else in the
engine dispatches by name. Static (ast): no model, no jax."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from multiserve.engine import commands

ENGINE = Path(__file__).resolve().parents[2] / "multiserve" / "engine" / "engine.py"


def _dispatch_cases() -> list[str]:
    tree = ast.parse(ENGINE.read_text())
    (fn,) = [n for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == "_dispatch"]
    (match,) = [n for n in ast.walk(fn) if isinstance(n, ast.Match)]
    return [c.pattern.cls.id for c in match.cases if isinstance(c.pattern, ast.MatchClass)]


def test_every_command_has_one_case() -> None:
    types = {t.__name__ for t in typing.get_args(commands.Command)}
    cases = _dispatch_cases()
    assert len(cases) == len(set(cases))
    assert set(cases) == types - {"Stop"}


def test_no_dispatch_by_name() -> None:
    text = ENGINE.read_text()
    assert "_cmd_" not in text and "getattr(self, f\"_" not in text
