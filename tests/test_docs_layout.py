"""docs/architecture.md §12 lists the package's files as they are: every module and native
source in multiserve/ (`__init__.py` aside) appears in the layout tree, and every file the
tree names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tree_paths() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## 12. Layout")
    end = text.find("\n## ", start)
    section = text[start:end if end != -1 else len(text)]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    stack: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or not re.search(r"(/|\.py|\.cc|\.h)$", m.group(2)):
            continue  # a description's continuation line
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(p for _, p in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            paths.add(path)
    return paths


def test_layout_tree_lists_every_module_and_nothing_else() -> None:
    listed = _tree_paths()
    present = {str(p.relative_to(REPO)) for p in (REPO / "multiserve").rglob("*")
               if p.suffix in (".py", ".cc", ".h") and p.name != "__init__.py"
               and "__pycache__" not in p.parts}
    assert listed, "no layout tree found"
    assert present - listed == set(), f"not in architecture.md §12: {sorted(present - listed)}"
    assert listed - present == set(), f"listed but absent: {sorted(listed - present)}"
