"""Every XLA product of the model multiplies its operands at their own precision.

An accelerator's default may round float32 operands to TF32 or bfloat16 before it multiplies
(XLA:GPU does on Ampere and later, the TPU's MXU does): a float32 engine would then serve
logprobs that are not its float32 model's, and the calibration's float32 references would not
be what the step computes. The first H200 run of scripts/device-check.sh found exactly that
(docs/performance.md §14). XLA:CPU computes float32 in float32 in any mode, so on the CPU
the property is checked where it is decided: in the lowered step program, where every
`dot_general` must carry precision HIGHEST (bfloat16 operands are exact in any mode)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, forward_program, products_on

from multiserve.model.families import family_for
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.invariance.plan import AttentionPlan, InvariancePlan
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import make_kv_pool
from multiserve.model.loading.param_layout import init_random_params

T = 16  # tokens of the lowered step
PAGE, BLOCK, PAGES = 16, 16, 8


def _xla_plan(plan: InvariancePlan, kernel: str) -> InvariancePlan:
    """`plan` with every product on XLA's `kernel` and attention on XLA's formulation (the
    formulations an accelerator runs: the native kernels are the CPU's)."""
    attention = AttentionPlan(((T, (T, T)),), shared_keys=False, kernel="xla")
    return dataclasses.replace(products_on(plan, kernel), attention=attention)


def _lowered_step(dtype: str, kernel: str) -> str:
    cfg = TINY_LLAMA
    np_dtype = jnp.dtype(dtype)
    raw = jax.tree.map(lambda a: a.astype(np_dtype), init_random_params(cfg, seed=1))
    params = family_for(cfg).compute_params(raw, cfg, None, ())
    plan = _xla_plan(default_plan(cfg, np_dtype, page_size=PAGE, block_size=BLOCK), kernel)
    kv = make_kv_pool(cfg, PAGES, PAGE, np_dtype)
    zeros = jnp.zeros(T, jnp.int32)
    batch = ForwardBatch(input_ids=zeros, positions=jnp.arange(T, dtype=jnp.int32),
                         token_seq=zeros, out_slots=jnp.arange(T, dtype=jnp.int32) + PAGE,
                         page_table=jnp.asarray(np.arange(1, 5, dtype=np.int32)[None, :]),
                         seq_lens=jnp.asarray([T], jnp.int32),
                         logit_rows=jnp.asarray([T - 1], jnp.int32))
    return forward_program(np_dtype).lower(params, kv, batch, cfg=cfg, page_size=PAGE,
                                           attn_block_size=BLOCK, plan=plan).as_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["plain", "nt"])
def test_every_product_of_the_step_multiplies_at_highest_precision(dtype: str,
                                                                   kernel: str) -> None:
    text = _lowered_step(dtype, kernel)
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # the layers' projections, the head, the row sums and attention's scores and values
    assert len(dots) >= 8, text
    loose = [line.strip() for line in dots
             if not re.search(r"precision\s*=\s*\[HIGHEST,\s*HIGHEST\]", line)]
    assert loose == [], "\n".join(loose)
