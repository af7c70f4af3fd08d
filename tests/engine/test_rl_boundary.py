"""The RL subsystem (engine/rl/, and engine/control_runner.py, which composes its managers)
stays behind its interface (issues 12, 21): it never assigns a field of anything but its own
objects, never touches a request's sink, and calls only the narrow interface it is given
(engine/rl_interface.RLInterface: hold/release_hold, swap_params, set_weight_version,
drop_kv/install_kv, ...): never a method of the core's parts (scheduler, prefix cache,
allocator, runner), and it names none of the first three. Static (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

from ast_targets import written

from multiserve.engine.rl_interface import RLInterface

ENGINE = Path(__file__).resolve().parents[2] / "multiserve" / "engine"
RL = ENGINE / "rl"
# the files held to the boundary: engine/rl/ and the runner that executes its commands
RL_FILES = sorted(RL.glob("*.py")) + [ENGINE / "control_runner.py"]
OWN = {"staged"}  # rl/weights.StagedWeights, the staging's own object
# what engine/rl/ may call: the public methods of the object it is given
CORE_INTERFACE = {n for n in dir(RLInterface) if not n.startswith("_")}
CORE_PARTS = {"scheduler", "cache", "allocator"}  # never named from engine/rl/


def _chain(node: ast.expr) -> list[str]:
    """`self.core.runner.kv` -> ["self", "core", "runner", "kv"] (subscripts skipped)."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        else:
            return ["<expr>", *parts[::-1]]


def _assigned_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for line, t in written(tree):
        if isinstance(t, (ast.Attribute, ast.Subscript)):
            chain = _chain(t)
            # allowed: a local (d[k] =), a field of its own object (self.x =,
            # self.x[k] =), and the StagedWeights it builds (staged.full[k] =)
            if len(chain) > 1 and not (chain[0] == "self" and len(chain) == 2) \
                    and chain[0] not in OWN:
                out.append((line, ".".join(chain)))
    return sorted(out)


def test_rl_assigns_only_its_own_fields_and_never_touches_a_sink() -> None:
    assert {f.name for f in RL_FILES} >= {"control_runner.py", "memory.py", "weights.py",
                                          "checks.py"}
    bad = []
    for f in RL_FILES:
        tree = ast.parse(f.read_text(), str(f))
        bad += [f"{f.name}:{line}: assigns {name}" for line, name in _assigned_attributes(tree)
                if f.name != "checks.py"]  # checks.py edits the trees it builds (set_leaf)
        bad += [f"{f.name}:{n.lineno}: touches a sink" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and "sink" in n.attr]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_foreign_assignment() -> None:
    tree = ast.parse("self.core.paused = True\nself.x = 1\nrunner.kv = None\nself.d[k] = 2\n"
                     "a, self.core.weight_version = 1, 2\nd[k] = 3\ncore.reqs[k] = 4\n")
    assert [n for _, n in _assigned_attributes(tree)] == [
        "self.core.paused", "runner.kv", "self.core.weight_version", "core.reqs"]


def _core_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls into the core that are not its narrow interface, and names of its parts."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in CORE_PARTS and \
                "core" in _chain(node)[:-1]:
            out.append((node.lineno, ".".join(_chain(node))))
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        chain = _chain(node.func)
        if "core" not in chain[:-1]:
            continue
        after = chain[chain.index("core") + 1:]
        if len(after) != 1 or after[0] not in CORE_INTERFACE:
            out.append((node.lineno, ".".join(chain) + "()"))
    return out


def test_rl_calls_only_the_cores_narrow_interface() -> None:
    bad = []
    for f in RL_FILES:
        tree = ast.parse(f.read_text(), str(f))
        bad += [f"{f.name}:{line}: {what}" for line, what in _core_calls(tree)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_call_into_the_cores_internals() -> None:
    tree = ast.parse("self.core.hold('x')\ncore.scheduler.retract(rs)\ns = core.cache\n"
                     "self.core.runner.reset_prev_ids()\ncore.finish(r)\ncore.drop_kv()\n")
    assert sorted(_core_calls(tree)) == [
        (2, "core.scheduler"), (2, "core.scheduler.retract()"), (3, "core.cache"),
        (4, "self.core.runner.reset_prev_ids()"), (5, "core.finish()")]
