"""The invariance plan the engine calibrates (model/invariance/calibration.py) is bitwise invariant on
the machine running these tests.

Nothing here hard-codes a backend fact: each test takes the plan that an engine would
calibrate here (the embedded model's shapes and a tiny model's, default buckets) and
checks that every primitive, computed the plan's way at every size the engine runs, gives
every row the same bits as at the largest size, with rows at several positions. A failure
means the calibration chose wrongly on this backend (fix the probe or the candidates,
never the test).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, head_shape, layer_matrix_shapes

from multiserve.config import EngineConfig
from multiserve.model.layers.attention import paged_attention
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.families.llama import plan_kernels
from multiserve.model.layers.norm import rms_norm
from multiserve.model.kernels.native import pack_panels
from multiserve.model.invariance.primitives import dense, row_sum

TOKENS = EngineConfig().precompile_token_paddings
ROWS = EngineConfig().precompile_bs_paddings


@pytest.fixture(scope="module", params=["default", "tiny"])
def model(request: pytest.FixtureRequest) -> tuple[object, InvariancePlan]:
    if request.param == "tiny":
        return TINY_LLAMA, default_plan(TINY_LLAMA)
    from multiserve.model.loading.loader import load_model

    cfg = load_model(None, np.float32).config
    return cfg, default_plan(cfg)


def _sizes_match(f, x: np.ndarray, sizes, *operands) -> list[int]:
    """Sizes M at which f(rows, *operands) differs from the full computation's rows, with
    the rows taken from the start, the end and a random choice of x (each row at other
    positions). Weights are operands, not constants of the program: a 576x49152 head
    folded into every compiled size made this test's compiles 10x slower."""
    fm = jax.jit(f)
    full = np.asarray(fm(x, *operands))
    rng = np.random.default_rng(0)
    bad = []
    for m in sizes:
        for idx in (np.arange(m), np.arange(len(x) - m, len(x)), rng.permutation(len(x))[:m]):
            if not np.array_equal(np.asarray(fm(x[idx], *operands)), full[idx]):
                bad.append(m)
                break
    return bad


def test_the_plan_is_verified_here(model) -> None:
    _, plan = model
    assert plan.verified, plan.problems


def test_every_product_is_row_invariant_by_the_plan(model) -> None:
    cfg, plan = model
    rng = np.random.default_rng(1)
    shapes = {**layer_matrix_shapes(cfg), "head": head_shape(cfg)}
    for name, (k, n) in shapes.items():
        sizes = ROWS if name == "head" else TOKENS
        w = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k))
        w_t = np.ascontiguousarray(w.T)
        w_p = pack_panels(jnp.asarray(w)) if plan_kernels(plan) & {"native"} else None
        x = rng.standard_normal((max(sizes), k), dtype=np.float32)
        product = plan.product(name)
        bad = _sizes_match(lambda xs, w, w_t, w_p, product=product: dense(
            xs, w=w, w_t=w_t, plan=product, w_p=w_p), x, sizes, w, w_t, w_p)
        assert bad == [], f"{name} {k}x{n}: rows differ at M={bad} ({plan.product(name)})"


def test_row_sums_and_rms_norm_are_row_invariant_by_the_plan(model) -> None:
    cfg, plan = model
    rng = np.random.default_rng(2)
    for rs in plan.row_sums:
        sizes = [m for m, _ in rs.by_rows]
        x = rng.standard_normal((max(sizes), rs.width), dtype=np.float32)
        assert _sizes_match(partial(row_sum, plan=rs), x, sizes) == []
        weight = 1.0 + 0.1 * rng.standard_normal(rs.width, dtype=np.float32)
        assert _sizes_match(lambda xs, weight, rs=rs: rms_norm(xs, weight=weight, eps=1e-5,
                                                               plan=rs), x, sizes,
                            weight) == []
        np.testing.assert_allclose(np.asarray(row_sum(x[:3], rs)), x[:3].sum(axis=1),
                                   rtol=1e-4, atol=1e-3)


def _attention_case(cfg, plan: InvariancePlan, page_size: int, block: int, seed: int):
    """A pool and T_max query rows: decode rows of many sequences, and two prefills whose
    chunks hold one sequence (shared keys)."""
    rng = np.random.default_rng(seed)
    kvh, hd = cfg.num_kv_heads, cfg.head_dim
    top = max(TOKENS)
    pages_per_seq, num_seqs = -(-(3 * block) // page_size), 40
    slots = (1 + pages_per_seq * num_seqs) * page_size
    k_pool = jnp.asarray(rng.standard_normal((2, kvh, slots, hd), dtype=np.float32))
    v_pool = jnp.asarray(rng.standard_normal((2, kvh, slots, hd), dtype=np.float32))
    table = jnp.asarray((1 + np.arange(num_seqs * pages_per_seq, dtype=np.int32))
                        .reshape(num_seqs, -1))
    half = top // 2
    seq = np.concatenate([rng.integers(2, num_seqs, half), np.full(top - half - 70, 0),
                          np.full(70, 1)]).astype(np.int32)
    pos = np.concatenate([rng.integers(0, 3 * block - 1, half),
                          np.arange(top - half - 70), 30 + np.arange(70)]).astype(np.int32)
    q = rng.standard_normal((top, cfg.num_heads, hd), dtype=np.float32)

    @jax.jit
    def attend_in(qs, ps, ss, k_pool, v_pool, table):  # the pool: operands, not constants
        t = qs.shape[0]
        batch = ForwardBatch(input_ids=jnp.zeros(t, jnp.int32), positions=ps, token_seq=ss,
                             out_slots=jnp.zeros(t, jnp.int32), page_table=table,
                             seq_lens=jnp.zeros(num_seqs, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return paged_attention(qs, k_pool, v_pool, 1, batch, page_size=page_size,
                               block_size=block, plan=plan.attention)

    def attend(qs, ps, ss):
        return attend_in(qs, ps, ss, k_pool, v_pool, table)

    return q, pos, seq, attend


def test_paged_attention_is_row_invariant_by_the_plan(model) -> None:
    cfg, plan = model
    q, pos, seq, attend = _attention_case(cfg, plan, 16, 128, 3)
    full = np.asarray(attend(q, pos, seq))
    rng = np.random.default_rng(4)
    bad = []
    for t in TOKENS:
        for idx in (np.arange(t), np.arange(len(q) - t, len(q)), rng.permutation(len(q))[:t]):
            if not np.array_equal(np.asarray(attend(q[idx], pos[idx], seq[idx])), full[idx]):
                bad.append(t)
                break
    assert bad == [], f"attention rows differ at T={bad} ({plan.attention})"


def test_prefill_rows_with_shared_keys_equal_lone_rows(model) -> None:
    """Every row of a full step (prefill chunks of one sequence gather each key block once
    when the plan allows it) equals the same row computed alone (a 1-token step)."""
    cfg, plan = model
    q, pos, seq, attend = _attention_case(cfg, plan, 16, 128, 5)
    full = np.asarray(attend(q, pos, seq))
    rows = list(range(len(q) - 80, len(q))) + [0, 7]
    bad = [i for i in rows if not np.array_equal(
        np.asarray(attend(q[i:i + 1], pos[i:i + 1], seq[i:i + 1])), full[i:i + 1])]
    assert bad == [], f"rows differ from their lone computation: {bad}"
