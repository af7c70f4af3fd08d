"""The compute params hold the output head only in the layouts the plan reads
(primitives.with_transposed): a head run natively keeps no transposed [D, V] copy (tied
embeddings) or [V, D] copy (untied), and its logits are bitwise those of the compute params
that hold every layout."""

from __future__ import annotations

import shutil
from dataclasses import replace

import jax
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, products_on

from multiserve.model.families.llama import lm_head, plan_kernels
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.invariance.primitives import with_transposed
from multiserve.model.kernels import native as native_kernels
from multiserve.model.loading.param_layout import init_random_params


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine uses the XLA formulation")
    assert native_kernels.unavailable_reason() is None


@pytest.mark.parametrize("tied", [True, False])
def test_a_native_head_holds_no_transposed_copy_and_gives_the_same_bits(tied: bool) -> None:
    cfg = replace(TINY_LLAMA, tie_word_embeddings=tied)
    params = jax.device_put(init_random_params(cfg, seed=3))
    plan = products_on(default_plan(cfg), "native")
    assert plan_kernels(plan) == {"native"}
    lean = with_transposed(params, cfg, kernels=plan_kernels(plan))
    full = with_transposed(params, cfg)  # every layout
    canonical = params["embed"] if tied else params["lm_head"]
    if tied:
        assert lean["head_w"] is None and lean["head_wt"] is canonical
    else:
        assert lean["head_w"] is canonical and lean["head_wt"] is None
    assert full["head_w"] is not None and full["head_wt"] is not None
    h = jax.numpy.asarray(np.random.default_rng(0).standard_normal((8, cfg.hidden_size)),
                          jax.numpy.float32)
    a = np.asarray(jax.jit(lambda p, x: lm_head(p, x, plan))(lean, h))
    b = np.asarray(jax.jit(lambda p, x: lm_head(p, x, plan))(full, h))
    assert a.tobytes() == b.tobytes()


def test_a_head_in_an_xla_layout_keeps_no_per_layer_copy_of_native_layers() -> None:
    """Layers native at every size, the head "plain" at one row count (a plan the
    calibration can pick by speed): the head keeps its [D, V] layout, and no layer matrix
    is copied per layer (those copies are for layers the plan runs with XLA's products:
    425 MB an engine of SmolLM2-135M); the logits at the plain size are the full params'."""
    from multiserve.model.families import family_for
    from multiserve.model.invariance.plan import Formulation
    from multiserve.model.invariance.primitives import LAYER_MATRICES

    cfg = TINY_LLAMA
    params = jax.device_put(init_random_params(cfg, seed=3))
    native = products_on(default_plan(cfg), "native")
    plan = replace(native, products=tuple(
        replace(p, by_rows=tuple((m, Formulation("plain", m) if m == 8 else f)
                                 for m, f in p.by_rows)) if p.name == "head" else p
        for p in native.products))
    assert plan_kernels(plan) == {"native", "plain"}
    assert plan_kernels(plan, LAYER_MATRICES) == {"native"}
    lean = family_for(cfg).compute_params(params, cfg, plan, (1, 8, 64))
    assert all(name not in layer for layer in lean["layers"] for name in LAYER_MATRICES)
    assert lean["head_w"] is not None and lean["head_wp"] is not None
    full = with_transposed(params, cfg)  # every layout
    h = jax.numpy.asarray(np.random.default_rng(0).standard_normal((8, cfg.hidden_size)),
                          jax.numpy.float32)
    a = np.asarray(jax.jit(lambda p, x: lm_head(p, x, plan))(lean, h))
    b = np.asarray(jax.jit(lambda p, x: lm_head(p, x, plan))(full, h))
    assert a.tobytes() == b.tobytes()
