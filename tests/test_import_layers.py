"""Arrows point down: the layers of multiserve import only the layers below them.

    cli, doctor, doctor_target, doctor_steps, bench/, reliability/   the commands
    server/, fleet/          the HTTP side and the fleet
    engine/                  the engine: never the HTTP side, the fleet or a command
    model/                   the model: never the engine (nor anything above it)
    types, sampling_policy   shared jax-free records and policies: import no side

Modules named in no layer (config, control_ops, grammar, parsing, host_heap, ...) are
helpers every layer may use; this file does not place them. Static (ast, the graph of
tests/test_import_cycles.py): every `import` anywhere in a module counts (top level, inside
a function, under TYPE_CHECKING), so a lazy import cannot hide an arrow pointing up. (That
`server/` never imports jax at run time is tests/server/test_import.py's.)
"""

from __future__ import annotations

from test_import_cycles import import_graph

COMMANDS = ("multiserve.cli", "multiserve.doctor", "multiserve.doctor_target",
            "multiserve.doctor_steps", "multiserve.bench", "multiserve.reliability")
HTTP_AND_FLEET = ("multiserve.server", "multiserve.fleet")
ENGINE = ("multiserve.engine",)
MODEL = ("multiserve.model",)
# jax-free shared modules every side imports: they import none of the packages above
SHARED = ("multiserve.types", "multiserve.sampling_policy")
# top to bottom: a module may import its own layer and the layers after it
LAYERS = (COMMANDS, HTTP_AND_FLEET, ENGINE, MODEL, SHARED)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def upward_arrows(graph: dict[str, set[str]], lower: tuple[str, ...],
                  upper: tuple[str, ...]) -> list[str]:
    """Every edge from a module in `lower` to one in `upper`, as "a -> b"."""
    return sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if _in(mod, lower)
                  for dep in deps if _in(dep, upper))


def arrows_up_the_layers(graph: dict[str, set[str]],
                         layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every edge from a layer to any layer above it (layers listed top to bottom)."""
    return sorted(arrow for i, layer in enumerate(layers) for above in layers[:i]
                  for arrow in upward_arrows(graph, layer, above))


def test_the_rule_sees_an_upward_import() -> None:
    graph = {"multiserve.engine.engine": {"multiserve.server.sglang_params",
                                          "multiserve.types"},
             "multiserve.server.app": {"multiserve.types"}}
    assert arrows_up_the_layers(graph) == [
        "multiserve.engine.engine -> multiserve.server.sglang_params"]


def test_the_rule_sees_the_model_import_the_engine() -> None:
    graph = {"multiserve.model.invariance.report": {"multiserve.engine.dtype_choice",
                                                    "multiserve.model.invariance.plan"},
             "multiserve.engine.setup": {"multiserve.model.invariance.plan"},
             "multiserve.doctor": {"multiserve.engine.dtype_choice", "multiserve.model"}}
    assert arrows_up_the_layers(graph) == [
        "multiserve.model.invariance.report -> multiserve.engine.dtype_choice"]


def test_the_rule_sees_a_command_imported_from_below() -> None:
    graph = {"multiserve.fleet.supervisor": {"multiserve.bench.run"},
             "multiserve.cli": {"multiserve.fleet.supervisor", "multiserve.doctor"}}
    assert arrows_up_the_layers(graph) == ["multiserve.fleet.supervisor -> multiserve.bench.run"]


def test_every_arrow_points_down() -> None:
    bad = arrows_up_the_layers(import_graph())
    assert not bad, "an import points up the layers: " + "; ".join(bad)


def test_engine_and_model_never_import_the_server_or_the_fleet() -> None:
    bad = upward_arrows(import_graph(), ENGINE + MODEL, HTTP_AND_FLEET)
    assert not bad, "engine/ or model/ imports the HTTP side or the fleet: " + "; ".join(bad)


def test_model_never_imports_the_engine() -> None:
    bad = upward_arrows(import_graph(), MODEL, ENGINE)
    assert not bad, "model/ imports engine/: " + "; ".join(bad)


def test_shared_records_import_no_side() -> None:
    bad = upward_arrows(import_graph(), SHARED, ENGINE + MODEL + HTTP_AND_FLEET)
    assert not bad, "a shared jax-free module imports a side: " + "; ".join(bad)


def test_every_layer_names_existing_modules() -> None:
    modules = set(import_graph())
    missing = [p for layer in LAYERS for p in layer if p not in modules]
    assert not missing, f"a layer names a module that does not exist: {missing}"
