"""bfloat16 (the accelerator default): params and KV pool in bf16 run the same forward,
return float32 logits, and stay close to the float32 forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from model_helpers import TINY_LLAMA, PagedSim

from multiserve.model.loading.param_layout import init_random_params


def test_bf16_forward_is_close_to_f32() -> None:
    host = init_random_params(TINY_LLAMA, seed=5, scale=0.3)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(3, TINY_LLAMA.vocab_size, 40)]
    out = {}
    for name, dtype in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16)):
        params = jax.device_put(jax.tree.map(lambda a, d=dtype: a.astype(d), host))
        sim = PagedSim(params, TINY_LLAMA, page_size=4, block_size=8, num_pages=64)
        assert sim.kv.k.dtype == jnp.dtype(dtype)
        sim.add("a", toks)
        got = sim.step([("a", 30)], logits_for={"a": list(range(30))})
        for _ in range(10):
            got.update(sim.step([("a", 1)]))
        out[name] = np.stack([got[("a", p)] for p in range(40)])
    assert out["bf16"].dtype == np.float32
    scale = np.max(np.abs(out["f32"]))
    assert np.max(np.abs(out["bf16"] - out["f32"])) < 0.1 * scale
    agree = np.mean(np.argmax(out["bf16"], -1) == np.argmax(out["f32"], -1))
    assert agree >= 0.8, agree


def test_scanned_bf16_decoder_copies_one_layer_not_the_stack(monkeypatch) -> None:
    """A step large enough to scan the layers, with every matrix on XLA's product: the
    program holds no copy of a bfloat16 weight stack (XLA:CPU widens a bf16 dynamic slice
    to float32 and hoists that widening of the whole stack out of the layer loop, writing
    it at every step), and its bits are the unrolled decoder's."""
    import dataclasses

    from multiserve.model.families import llama
    from multiserve.model.invariance.plan import (AttentionPlan, Formulation,
                                                  InvariancePlan, ProductPlan, RowSumPlan)
    from multiserve.model.invariance.primitives import LAYER_MATRICES, with_transposed
    from multiserve.model.layers.forward_batch import ForwardBatch
    from multiserve.model.layers.kv_pool import make_kv_pool

    cfg = dataclasses.replace(TINY_LLAMA, intermediate_size=2048, num_layers=8)
    t = 128
    plain = (t, Formulation("plain", t))
    plan = InvariancePlan(
        products=tuple(ProductPlan(name, 0, 0, (plain,))  # k, n: read by native plans only
                       for name in (*LAYER_MATRICES, "head")),
        row_sums=(RowSumPlan(cfg.hidden_size, ((t, t),)),),
        attention=AttentionPlan(((t, (t, t)),), False, "xla"), verified=False)
    host = init_random_params(cfg, seed=3, scale=0.3)
    params = with_transposed(jax.device_put(jax.tree.map(
        lambda a: a.astype(ml_dtypes.bfloat16), host)), cfg, kernels=frozenset({"plain"}))
    stacks = sum(a.nbytes for a in params["stacked_layers"].values() if a.ndim == 3)
    rng = np.random.default_rng(0)
    batch = ForwardBatch(
        input_ids=jnp.asarray(rng.integers(3, cfg.vocab_size, t), jnp.int32),
        positions=jnp.arange(t, dtype=jnp.int32), token_seq=jnp.zeros(t, jnp.int32),
        out_slots=jnp.arange(16, 16 + t, dtype=jnp.int32),
        page_table=jnp.arange(1, 9, dtype=jnp.int32)[None],
        seq_lens=jnp.full(1, t, jnp.int32), logit_rows=jnp.arange(0, t, 7, dtype=jnp.int32))

    def run(unroll_max: int) -> tuple[int, tuple[np.ndarray, ...]]:
        monkeypatch.setattr(llama, "UNROLL_MAX_TOKENS", unroll_max)
        assert llama.scans(plan, t) == (unroll_max < t)
        fn = jax.jit(lambda p, kv, b: llama.forward_hidden(p, kv, b, cfg, page_size=16,
                                                           attn_block_size=16, plan=plan))
        kv = make_kv_pool(cfg, 10, 16, jnp.bfloat16)
        compiled = fn.lower(params, kv, batch).compile()
        h, kv = compiled(params, kv, batch)
        temp = compiled.memory_analysis().temp_size_in_bytes
        return temp, tuple(np.asarray(a).view(np.uint16) for a in (h, kv.k, kv.v))

    temp, scanned = run(llama.UNROLL_MAX_TOKENS)
    assert temp < stacks, (temp, stacks)
    _, unrolled = run(t)
    for a, b in zip(scanned, unrolled, strict=True):
        assert np.array_equal(a, b)
