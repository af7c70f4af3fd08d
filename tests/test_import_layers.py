"""Arrows point down: the layers of multiserve import only the layers below them.

    server/, fleet/          the HTTP side and the fleet (may import everything below)
    engine/, model/          the device side: never the HTTP side or the fleet
    types, config, sampling_policy, ...   shared jax-free records and policies

Static (ast, the graph of tests/test_import_cycles.py): every `import` anywhere in a module
counts (top level, inside a function, under TYPE_CHECKING), so a lazy import cannot hide
an arrow pointing up. (That `server/` never imports jax at run time is
tests/server/test_import.py's.)
"""

from __future__ import annotations

from test_import_cycles import import_graph

DEVICE_SIDE = ("multiserve.engine", "multiserve.model")
ABOVE_DEVICE = ("multiserve.server", "multiserve.fleet")
# jax-free shared modules every side imports: they import none of the packages above
SHARED = ("multiserve.types", "multiserve.sampling_policy")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def upward_arrows(graph: dict[str, set[str]], lower: tuple[str, ...],
                  upper: tuple[str, ...]) -> list[str]:
    """Every edge from a module in `lower` to one in `upper`, as "a -> b"."""
    return sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if _in(mod, lower)
                  for dep in deps if _in(dep, upper))


def test_the_rule_sees_an_upward_import() -> None:
    graph = {"multiserve.engine.engine": {"multiserve.server.sglang_params",
                                          "multiserve.types"},
             "multiserve.server.app": {"multiserve.types"}}
    assert upward_arrows(graph, DEVICE_SIDE, ABOVE_DEVICE) == [
        "multiserve.engine.engine -> multiserve.server.sglang_params"]


def test_engine_and_model_never_import_the_server_or_the_fleet() -> None:
    bad = upward_arrows(import_graph(), DEVICE_SIDE, ABOVE_DEVICE)
    assert not bad, "engine/ or model/ imports the HTTP side or the fleet: " + "; ".join(bad)


def test_shared_records_import_no_side() -> None:
    bad = upward_arrows(import_graph(), SHARED, DEVICE_SIDE + ABOVE_DEVICE)
    assert not bad, "a shared jax-free module imports a side: " + "; ".join(bad)
