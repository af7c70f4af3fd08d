"""Leaves of a params-like pytree (nested dicts of arrays, e.g. the canonical params):
read one (`get_leaf`), write one (`set_leaf`), list them (`leaf_paths`), and THE leaf swap
(`with_leaves`: a copy of the tree with some leaves replaced, and the leaves it replaced).

Invariant: `with_leaves` never changes the tree it is given (the live params stay whole
until their owner installs the new tree), and it returns every leaf it replaced, so the
owner can free them once nothing reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

LeafPath = tuple[str, ...]  # ("embed",), ("layers", "wq"), ("moe", "we_gate")


def get_leaf(tree: Any, path: LeafPath) -> Any:
    """The leaf of a params-like pytree (nested dicts) at `path`, e.g. ("layers", "wq")."""
    for key in path:
        tree = tree[key]
    return tree


def set_leaf(tree: dict[str, Any], path: LeafPath, value: Any) -> None:
    """Write the leaf at `path` of `tree` (in place)."""
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def leaf_paths(shapes: Mapping[str, Any]) -> list[LeafPath]:
    """The paths of a two-level params-like tree's leaves, in its order."""
    out: list[LeafPath] = []
    for k, v in shapes.items():
        if isinstance(v, Mapping):
            out += [(k, kk) for kk in v]
        else:
            out.append((k,))
    return out


def with_leaves(tree: Any, paths: Iterable[LeafPath],
                new_leaf: Callable[[LeafPath, Any], Any]) -> tuple[Any, list[Any]]:
    """(a copy of `tree` whose leaf at each of `paths` is `new_leaf(path, old leaf)`, the
    old leaves it replaced, in order). `tree` is left as it was."""
    new = jax.tree.map(lambda a: a, tree)
    replaced = []
    for path in paths:
        old = get_leaf(tree, path)
        set_leaf(new, path, new_leaf(path, old))
        replaced.append(old)
    return new, replaced
