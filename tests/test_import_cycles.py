"""No import cycles among multiserve's modules.

The graph is static (ast): every `import` / `from ... import` anywhere in a module (top
level, inside functions, under TYPE_CHECKING) is an edge to the most specific multiserve
module it names. A function-level import that closes a cycle is still a cycle: it only
hides the knot from the interpreter, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "multiserve"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                if t.split(".")[0] != "multiserve":
                    continue
                dep = _resolve(t, modules)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def test_the_detector_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "multiserve.engine.engine" in graph["multiserve"]  # lazy, inside __getattr__
    assert "multiserve.engine.sched.scheduler" in graph["multiserve.engine.core"]


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among multiserve modules: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_every_multiserve_import_names_an_existing_module() -> None:
    """`from multiserve.x.y import z` and `import multiserve.x.y` name a module or package
    that exists (the graph above resolves a missing one to its package, so a stale import
    under TYPE_CHECKING would pass it unseen)."""
    modules = _modules()
    missing = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            missing += [f"{mod}: {n}" for n in names
                        if n.split(".")[0] == "multiserve" and n not in modules]
    assert not missing, "imports of modules that do not exist: " + "; ".join(missing)
