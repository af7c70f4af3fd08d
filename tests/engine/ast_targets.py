"""What a module writes, for the static ownership tests (test_rl_boundary,
test_req_ownership): every assignment target, flattened out of tuples and lists."""

from __future__ import annotations

import ast
from collections.abc import Iterator


def written(tree: ast.AST, mutators: frozenset[str] = frozenset()
            ) -> Iterator[tuple[int, ast.expr]]:
    """(line, target) of every `x = `, `x += `, `x: T = ` in `tree`, and of every call
    `x.m(...)` with m in `mutators` (target x)."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in mutators:
            targets = [node.func.value]
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            else:
                yield node.lineno, t
