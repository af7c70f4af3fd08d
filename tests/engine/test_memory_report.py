"""What an engine says it holds (get_internal_state "memory", engine/memory_report.py): the
weights' bytes are the params' shapes times the dtype, the KV pool's are its tokens times
bytes per token, the compiled programs are counted, and a pool sized by the host rule says
so (engine/base/kv_sizing.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from conftest import TINY_MODEL, tiny_params
from engine_helpers import TINY_ENGINE

from multiserve.model.loading.param_layout import param_shapes

# K and V, 2 layers x 2 KV heads x 16 dims, float32
TINY_F32_TOKEN = 2 * TINY_MODEL.num_layers * TINY_MODEL.num_kv_heads * TINY_MODEL.head_dim * 4


def _param_bytes() -> int:
    shapes = [s for s in jax.tree.leaves(param_shapes(TINY_MODEL),
                                         is_leaf=lambda x: isinstance(x, tuple))]
    return sum(math.prod(s) for s in shapes) * 4


def test_memory_block_counts_weights_kv_and_programs(tiny_engine: Any) -> None:
    assert tiny_engine.wait_compiled(120)
    state = tiny_engine.get_internal_state()
    mem = state["memory"]
    assert mem["weights_params_bytes"] == _param_bytes()
    assert mem["weights_bytes"] == mem["weights_params_bytes"] + mem["weights_copies_bytes"]
    assert mem["weights_copies_bytes"] >= 0
    # each weight held once: where the plan holds every layer matrix as native panels and
    # no scanned step size reads the canonical stacks (the plain product), the canonical
    # matrices are not kept (the panels rebuild them, bit for bit); which kernels the
    # calibration picks at each size depends on its timings, so the rule is checked, not
    # one outcome
    from multiserve.engine.commands import Call
    from multiserve.model.families.llama import scan_needs_plain
    from multiserve.model.invariance.primitives import LAYER_MATRICES

    runner = tiny_engine._core.runner  # noqa: SLF001 - what the engine holds
    kernels = {f.kernel for p in runner.plan.products if p.name in LAYER_MATRICES
               for _, f in p.by_rows}
    dropped = [m for m in LAYER_MATRICES if m not in runner.held_params["layers"]]
    sizes = TINY_ENGINE["precompile_token_paddings"]
    held_once = "native" in kernels and not scan_needs_plain(runner.plan, sizes)
    assert dropped == (list(LAYER_MATRICES) if held_once else [])
    layer_bytes = sum(math.prod(param_shapes(TINY_MODEL)["layers"][m]) * 4 for m in dropped)
    assert mem["weights_canonical_bytes"] == _param_bytes() - layer_bytes
    host = tiny_params(TINY_MODEL)
    rebuilt = tiny_engine.call(Call(lambda core: jax.tree.map(
        np.asarray, core.runner.params))).result()
    assert jax.tree.structure(rebuilt) == jax.tree.structure(host)
    for got, want in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(host), strict=True):
        assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert mem["kv_bytes_per_token"] == TINY_F32_TOKEN
    assert mem["kv_pool_tokens"] == TINY_ENGINE["max_total_tokens"] == state["max_total_tokens"]
    assert mem["kv_pool_padding_tokens"] == TINY_ENGINE["page_size"]
    assert mem["kv_pool_bytes"] == (mem["kv_pool_tokens"] + mem["kv_pool_padding_tokens"]) \
        * mem["kv_bytes_per_token"]
    assert (mem["kv_pool_rule"], mem["kv_pool_budget_bytes"]) == ("explicit", None)
    programs = mem["programs"]
    # every compiled bucket is at least one executable (a head: logits and sampler)
    assert programs["count"] >= len(state["compile"]["compiled"]) > 0
    assert programs["temp_bytes_total"] >= programs["temp_bytes_max"] >= 0
    assert programs["generated_code_bytes"] is None or programs["generated_code_bytes"] > 0
    assert mem["released"] == []


def test_an_unsized_pool_follows_the_host_rule(tiny_model_dir: Path) -> None:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    cfg = EngineConfig(model_path=str(tiny_model_dir), **{
        **TINY_ENGINE, "max_total_tokens": None, "host_kv_max_tokens": 1024, "warmup": False})
    eng = Engine(cfg)
    try:
        mem = eng.get_internal_state()["memory"]
    finally:
        eng.shutdown()
    # the tiny model's tokens are small: 10% of any host's share holds more than the cap
    assert mem["kv_pool_rule"] == "host memory"
    assert mem["kv_pool_tokens"] == 1024
    assert mem["kv_pool_budget_bytes"] > 1024 * TINY_F32_TOKEN
    assert mem["kv_pool_bytes"] == (1024 + TINY_ENGINE["page_size"]) * TINY_F32_TOKEN
