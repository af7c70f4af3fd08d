"""Names in the docs are true. docs/architecture.md §2 maps the package: every folder of
multiserve/ appears on the map, and every path the map names exists; below a folder the
modules tell themselves (each opens with a docstring, §12). And every file name and module
the prose names (docstrings, comments, docs/, sops/, README.md) exists."""

from __future__ import annotations

import ast
import fnmatch
import io
import os
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _map_paths() -> set[str]:
    """The paths (relative to the repository) that §2's map names: folders end in "/"."""
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## 2. Rooms")
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
        if indent == 0 and name != "multiserve/":  # `plugins/  configs/  ...`: top folders
            paths.update(w for w in line.split() if w.endswith("/"))
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(p for _, p in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        paths.add(path)
    return paths


def test_the_map_shows_every_folder_and_names_only_what_exists() -> None:
    listed = _map_paths()
    assert listed, "no map found in architecture.md §2"
    folders = {str(p.relative_to(REPO)) + "/" for p in (REPO / "multiserve").rglob("*")
               if p.is_dir() and "__pycache__" not in p.parts}
    folders.add("multiserve/")
    assert folders - listed == set(), f"folders not on architecture.md §2's map: " \
                                      f"{sorted(folders - listed)}"
    absent = sorted(p for p in listed if not (REPO / p).exists()
                    or (REPO / p).is_dir() != p.endswith("/"))
    assert absent == [], f"on architecture.md §2's map but absent: {absent}"


def test_every_module_opens_with_a_docstring() -> None:
    """§12: below the map's folders each module says what it is."""
    bare = sorted(str(p.relative_to(REPO)) for p in (REPO / "multiserve").rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts
                  and not ast.get_docstring(ast.parse(p.read_text())))
    assert bare == [], f"modules without a docstring: {bare}"


# ---- names true: every file and module the prose names exists ----------------------------
# The prose: docstrings and comments of multiserve/, scripts/ and plugins/ (Python, shell,
# C/C++), and docs/, sops/ and README.md whole. A file name is a word ending in one of
# FILE_SUFFIXES: with a directory (`engine/sched/scheduler.py`, `configs/cpu-4.toml`) it
# names a file whose path ends so; bare (`scheduler.py`) some file of that name. A module
# reference is a backticked dotted name whose head is a snake_case module-like word
# (`row_invariant.dense`): its head must be a name the repository's Python defines or uses.
# Not names of files: URLs, globs and templates (`native/*.cc`, `{name}_generate.py`,
# `plugins/peers/NAME_generate.py`: an upper-case word before "_" is a placeholder), and
# the other projects' files in OTHER_PROJECTS_FILES.

FILE_SUFFIXES = ("py", "md", "sh", "toml", "cc", "h", "c")
PROSE_DIRS = ("multiserve", "scripts", "plugins")
DOC_DIRS = ("docs", "sops")
# files of other projects that the prose names (none so far: the C++ includes are code)
OTHER_PROJECTS_FILES: frozenset[str] = frozenset()
_SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "build"}

_FILE_NAME = re.compile(r"(?<![\w/.:~$*{}<>@-])((?:[\w.-]+/)*[\w-]+\.(?:%s))(?![\w/*{}<>-])"
                        % "|".join(FILE_SUFFIXES))
_URL = re.compile(r"\w+://\S+")
# a data file's name (`tokenizer_config.json`) is not a module reference
_MODULE_REF = re.compile(r"`([a-z][a-z0-9]*_[a-z0-9_]*)(?!\.(?:json|safetensors|gguf|txt)`)"
                         r"(?:\.[A-Za-z_]\w*)+(?:\([^`]*\))?`")
_PLACEHOLDER = re.compile(r"\b[A-Z]+(?=_)")


def _repo_files() -> list[str]:
    """Every file of the tree, less the skipped directories and every venv (.venv,
    .venv-tunix, .venv-peers/...), which are pruned, not walked."""
    out: list[str] = []
    for top, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".venv")]
        out += [os.path.relpath(os.path.join(top, n), REPO) for n in names]
    return sorted(out)


def _python_prose(text: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment of a Python source."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    out += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type == tokenize.COMMENT]
    return out


def _prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of the prose of one file: see the comment above."""
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return _python_prose(text)
    if path.suffix == ".sh":
        return [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1)
                if "#" in line]
    if path.suffix in (".cc", ".h", ".c"):
        return [(text.count("\n", 0, m.start()) + 1, m.group(0))
                for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S)]
    return [(1, text)]


def _prose_files(files: list[str]) -> list[str]:
    return [f for f in files if (f.split("/")[0] in PROSE_DIRS and
                                 f.endswith((".py", ".sh", ".cc", ".h", ".c")))
            or (f.split("/")[0] in DOC_DIRS and f.endswith(".md")) or f == "README.md"]


def _file_exists(name: str, files: list[str], basenames: set[str]) -> bool:
    if name in OTHER_PROJECTS_FILES:
        return True
    if "/" not in name:
        return name in basenames or fnmatch.filter(basenames, _PLACEHOLDER.sub("*", name)) != []
    pattern = _PLACEHOLDER.sub("*", name)
    return any(f == name or f.endswith("/" + name) or fnmatch.fnmatch(f, pattern)
               or fnmatch.fnmatch(f, "*/" + pattern) for f in files)


def _python_names(files: list[str]) -> set[str]:
    """Every name the repository's Python defines or uses (modules, packages, functions,
    classes, arguments, attributes, imported names), string literals aside."""
    names = {part for f in files for part in Path(f).with_suffix("").parts}
    for f in files:
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((REPO / f).read_text(), f)):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.update([*node.name.split("."), node.asname or ""])
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.update(node.module.split("."))
    return names


def stale_names(prose: dict[str, list[tuple[int, str]]], files: list[str],
                python_names: set[str]) -> list[str]:
    """"path:line: name" for every file name or module reference in `prose` (a file's
    (first line, text) pieces) that names nothing in `files` / `python_names`."""
    basenames = {Path(f).name for f in files}
    bad = []
    for path, pieces in prose.items():
        for first, text in pieces:
            for i, line in enumerate(text.splitlines()):
                line = _URL.sub("", line)
                bad += [f"{path}:{first + i}: {m.group(1)}" for m in _FILE_NAME.finditer(line)
                        if not _file_exists(m.group(1), files, basenames)]
                bad += [f"{path}:{first + i}: {m.group(0)}" for m in _MODULE_REF.finditer(line)
                        if m.group(1) not in python_names]
    return bad


def test_the_matcher_sees_stale_names_and_only_them() -> None:
    files = ["multiserve/engine/sched/scheduler.py", "multiserve/model/kernels/src/row_gemm.cc",
             "plugins/peers/vllm_generate.py", "configs/cpu-4.toml", "README.md"]
    text = ("engine/sched/scheduler.py and scheduler.py, src/row_gemm.cc, README.md,\n"
            "configs/cpu-4.toml; native/*.cc, {name}_generate.py, plugins/peers/NAME_generate.py,"
            "\nhttps://example.org/x/setup.py, `dense.forward`, self.cfg, 1.5, e.g. resp.json\n"
            "engine/sched/batch.py, row_invariant.py, native/row_gemm.cc, `row_invariant.dense`"
            ", `hf_loader.read(x)`\n")
    assert stale_names({"m.py": [(10, text)]}, files, {"dense", "forward", "hf_loader"}) == [
        "m.py:13: engine/sched/batch.py", "m.py:13: row_invariant.py",
        "m.py:13: native/row_gemm.cc", "m.py:13: `row_invariant.dense`"]


def test_the_prose_reads_docstrings_and_comments_not_code() -> None:
    text = '"""Doc: a.py."""\nx = "b.py"  # c.py\n\n\ndef f():\n    """d.py"""\n'
    assert sorted(_python_prose(text)) == [(1, "Doc: a.py."), (2, "# c.py"), (6, "d.py")]


def test_every_file_and_module_the_prose_names_exists() -> None:
    files = _repo_files()
    prose = {f: _prose(REPO / f) for f in _prose_files(files)}
    bad = stale_names(prose, files, _python_names(files))
    assert not bad, "names of nothing:\n" + "\n".join(bad)
