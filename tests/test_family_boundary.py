"""The engine, the calibration, the loaders and sharding reach a model family only through
its interface (model/families/base.py, `family_for(cfg)`): none imports a family's own
modules (its forward, its layout), so adding a family touches none of them."""

from __future__ import annotations

from test_import_cycles import import_graph

FAMILY_MODULES = {f"multiserve.model.families.{m}"
                  for m in ("dense", "qwen_moe", "llama", "moe", "moe_decoder", "mistral",
                            "gemma", "sliding", "mixtral", "gpt_oss", "gpt_oss_moe")}
INTERFACE_ONLY = ("multiserve.engine", "multiserve.model.invariance",
                  "multiserve.model.loading", "multiserve.model.sharding")


def test_the_engine_and_the_calibration_import_no_family_module() -> None:
    graph = import_graph()
    bad = {m: sorted(deps & FAMILY_MODULES) for m, deps in graph.items()
           if m.startswith(INTERFACE_ONLY) and deps & FAMILY_MODULES}
    assert not bad, f"imports of a family's own modules (use family_for(cfg)): {bad}"
    # the check sees the edges it looks for
    assert "multiserve.model.families.llama" in graph["multiserve.model.families.dense"]
