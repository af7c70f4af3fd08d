"""A request's state has one writer (issue 21): outside its constructor, only the Scheduler
(engine/sched/scheduler.py and its parts: state.py, decode_rows.py, prefill_rows.py,
postprocess.py) changes a Req's fields; the one exception is the delivery
cursor, advanced by Req.next_delta (engine/sched/request.py). Static (ast) over every
module of the package: no assignment to, and no append/extend/pop/... on, a Req field of
anything but `self` (another object's own field of the same name is fine)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from ast_targets import written

from multiserve.engine.sched.request import Req

PKG = Path(__file__).resolve().parents[2] / "multiserve"
FIELDS = {f.name for f in dataclasses.fields(Req)}
OWNERS = {"engine/sched/scheduler.py", "engine/sched/state.py", "engine/sched/decode_rows.py",
          "engine/sched/prefill_rows.py", "engine/sched/postprocess.py",
          "engine/sched/request.py"}
MUTATORS = frozenset({"append", "extend", "pop", "clear", "insert", "remove", "update"})
# objects that are not Reqs but have fields of the same names: (file, variable)
NOT_REQS = {("engine/streams.py", "s"), ("multihost/session.py", "session")}


def _base(node: ast.expr) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else "<expr>"


def req_field_writes(tree: ast.AST, rel: str) -> list[str]:
    out: list[tuple[int, str]] = []
    for line, t in written(tree, MUTATORS):
        if isinstance(t, ast.Subscript):
            t = t.value
        if not (isinstance(t, ast.Attribute) and t.attr in FIELDS):
            continue
        owner = t.value
        if isinstance(owner, ast.Name) and owner.id == "self":
            continue  # an object's own field
        if (owner.attr if isinstance(owner, ast.Attribute) else
                getattr(owner, "id", None)) == "runner":
            continue  # the runner's params
        if (rel, _base(owner)) in NOT_REQS:
            continue
        out.append((line, f"{rel}:{line}: {ast.unparse(t)}"))
    return [w for _, w in sorted(out)]


def test_only_the_scheduler_writes_request_state() -> None:
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).as_posix()
        if rel.startswith(("server/", "bench/", "reliability/")) or rel in OWNERS:
            continue  # no Req lives there (their "finish_reason"s are their own types')
        bad += req_field_writes(ast.parse(f.read_text()), rel)
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_foreign_write() -> None:
    tree = ast.parse("req.status = 1\nself.status = 2\nr.output_ids.append(3)\n"
                     "row.req.pending -= 1\nrunner.params = 4\nx.unrelated = 5\n")
    assert [w.split(": ", 1)[1] for w in req_field_writes(tree, "engine/x.py")] == [
        "req.status", "r.output_ids", "row.req.pending"]
