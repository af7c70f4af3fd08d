"""Typed commands, one dispatch (issues 12, 21): every command type of engine/commands.py
has exactly one case: in `Engine._dispatch` (Stop is the loop's own), or, for the RL
commands (`RLCommand`, which the dispatch hands over as a group), in
`ControlRunner.execute`; and nothing else in the engine dispatches by name. Static (ast): no
model, no jax."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from multiserve.engine import commands

ENGINE = Path(__file__).resolve().parents[2] / "multiserve" / "engine" / "engine.py"
CONTROL_RUNNER = ENGINE.parent / "control_runner.py"


def _cases(path: Path = ENGINE, function: str = "_dispatch") -> list[str]:
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == function]
    (match,) = [n for n in ast.walk(fn) if isinstance(n, ast.Match)]
    return [c.pattern.cls.id for c in match.cases if isinstance(c.pattern, ast.MatchClass)]


def test_every_command_has_one_case() -> None:
    types = {t.__name__ for t in typing.get_args(commands.Command)}
    rl = {t.__name__ for t in typing.get_args(commands.RLCommand)}
    assert rl == {t.__name__ for t in commands.RL_COMMANDS}
    cases = _cases()
    assert len(cases) == len(set(cases))
    assert set(cases) == types - {"Stop"} - rl
    rl_cases = _cases(CONTROL_RUNNER, "execute")
    assert len(rl_cases) == len(set(rl_cases))
    assert set(rl_cases) == rl
    assert "RL_COMMANDS" in ENGINE.read_text()  # the dispatch's one case for the group


def test_no_dispatch_by_name() -> None:
    text = ENGINE.read_text()
    assert "_cmd_" not in text and "getattr(self, f\"_" not in text
