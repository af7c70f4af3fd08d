"""Arrows point down: the layers of multiserve import only the layers below them.

    cli, doctor/, bench/, reliability/   the commands
    server/, fleet/          the HTTP side and the fleet (fleet/follower.py: a follower host)
    engine/                  the engine: never the HTTP side, the fleet or a command
    multihost/               one engine's step stream across hosts: never the engine
    model/                   the model: never the engine (nor anything above it)
    types, sampling_policy, host/   shared jax-free records, policies and host utilities:
                             import no side

Inside the engine, its rooms by floor (`ENGINE_FLOORS`, top to bottom): the thread and the
core (engine.py, core.py, control, setup, RL) over the rooms a step passes through, over
engine/base/, the leaf utilities, which import nothing else of the engine.

Modules named in no layer (config, control_ops, grammar, parsing, cache_files, ...) are
helpers every layer may use; this file does not place them. Static (ast, the graph of
tests/test_import_cycles.py): every `import` anywhere in a module counts (top level, inside
a function, under TYPE_CHECKING), so a lazy import cannot hide an arrow pointing up. (That
`server/` never imports jax at run time is tests/server/test_import.py's.)
"""

from __future__ import annotations

from test_import_cycles import import_graph

COMMANDS = ("multiserve.cli", "multiserve.doctor", "multiserve.bench", "multiserve.reliability")
HTTP_AND_FLEET = ("multiserve.server", "multiserve.fleet")
ENGINE = ("multiserve.engine",)
MULTIHOST = ("multiserve.multihost",)
MODEL = ("multiserve.model",)
# jax-free shared modules every side imports: they import none of the packages above
SHARED = ("multiserve.types", "multiserve.sampling_policy", "multiserve.host")
# top to bottom: a module may import its own layer and the layers after it
LAYERS = (COMMANDS, HTTP_AND_FLEET, ENGINE, MULTIHOST, MODEL, SHARED)
# the engine's rooms, top to bottom (each may import its own floor and those below it)
ENGINE_BASE = ("multiserve.engine.base",)
ENGINE_ROOMS = tuple(f"multiserve.engine.{room}" for room in (
    "sched", "spec", "sampling", "step_inputs", "device"))
ENGINE_TOP = tuple(f"multiserve.engine.{m}" for m in (
    "engine", "core", "commands", "control_runner", "setup", "rl_interface", "rl",
    "lora_control", "state_report", "memory_report", "streams",
    "wait_pause", "host_phases"))
ENGINE_FLOORS = (ENGINE_TOP, ENGINE_ROOMS, ENGINE_BASE)


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
    graph = {"multiserve.model.invariance.report": {"multiserve.engine.base.dtype_choice",
                                                    "multiserve.model.invariance.plan"},
             "multiserve.engine.setup": {"multiserve.model.invariance.plan"},
             "multiserve.doctor.main": {"multiserve.engine.base.dtype_choice", "multiserve.model"}}
    assert arrows_up_the_layers(graph) == [
        "multiserve.model.invariance.report -> multiserve.engine.base.dtype_choice"]


def test_the_rule_sees_a_command_imported_from_below() -> None:
    graph = {"multiserve.fleet.supervisor": {"multiserve.bench.run"},
             "multiserve.cli": {"multiserve.fleet.supervisor", "multiserve.doctor.main"}}
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


def test_the_engines_rooms_point_down() -> None:
    bad = arrows_up_the_layers(import_graph(), ENGINE_FLOORS)
    assert not bad, "an import points up the engine's floors: " + "; ".join(bad)


def test_every_engine_module_is_on_a_floor() -> None:
    loose = [m for m in import_graph() if _in(m, ENGINE) and m != "multiserve.engine"
             and not any(_in(m, floor) for floor in ENGINE_FLOORS)]
    assert not loose, f"engine modules on no floor (tests/test_import_layers.py): {loose}"


def test_every_layer_names_existing_modules() -> None:
    modules = set(import_graph())
    missing = [p for layer in (*LAYERS, *ENGINE_FLOORS) for p in layer if p not in modules]
    assert not missing, f"a layer names a module that does not exist: {missing}"
