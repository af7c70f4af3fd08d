"""The native CPU kernels (paged attention, the row-invariant product): they build here,
compute what XLA's formulations compute (fp32 tolerance), are bitwise row-invariant, and
the calibration chooses them where they can run and falls back to XLA's where they
cannot."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, products_on

from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.attention import paged_attention
from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.workload import workload_for
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.invariance.plan import AttentionPlan

XLA = AttentionPlan(((1 << 20, (4, 4)),), False)  # chunks of 4 rows, any T
NATIVE = AttentionPlan(((1 << 20, (1, 1)),), False, "native")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine uses the XLA formulation")
    assert native_kernels.unavailable_reason() is None


def _case(kv_heads: int, group: int, head_dim: int, page_size: int, seed: int = 0,
          num_layers: int = 3):
    """16 sequences in a shuffled page table; 40 decode rows at positions up to ~300 and a
    24-token prefill run of one sequence."""
    rng = np.random.default_rng(seed)
    num_seqs, max_pages = 16, -(-320 // page_size)
    slots = (1 + num_seqs * max_pages) * page_size
    pool = (num_layers, kv_heads, slots, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(pool), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal(pool), jnp.float32)
    table = jnp.asarray((1 + rng.permutation(num_seqs * max_pages)).reshape(num_seqs, -1)
                        .astype(np.int32))
    seq = np.concatenate([rng.integers(0, num_seqs - 1, 40), np.full(24, num_seqs - 1)])
    pos = np.concatenate([rng.integers(0, 300, 40), 150 + np.arange(24)])
    q = jnp.asarray(rng.standard_normal((len(seq), kv_heads * group, head_dim)), jnp.float32)
    # one jitted function per plan; the pools are arguments (as closure constants they were
    # embedded in every program), so a row count compiles once, whatever rows it picks
    fns = {plan: jax.jit(lambda qs, kp, vp, b, lay, plan=plan: paged_attention(
        qs, kp, vp, lay, b, page_size=page_size, block_size=32, plan=plan))
        for plan in (XLA, NATIVE)}

    def attend(plan: AttentionPlan, idx: np.ndarray, layer=1) -> np.ndarray:
        n = len(idx)
        batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32),
                             positions=jnp.asarray(pos[idx], jnp.int32),
                             token_seq=jnp.asarray(seq[idx], jnp.int32),
                             out_slots=jnp.zeros(n, jnp.int32), page_table=table,
                             seq_lens=jnp.zeros(num_seqs, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return np.asarray(fns[plan](q[idx], k_pool, v_pool, batch, jnp.int32(layer)))

    return len(seq), attend


@pytest.mark.parametrize("kv_heads,group,head_dim,page_size",
                         [(3, 3, 64, 16), (2, 1, 32, 8), (1, 4, 128, 16), (2, 2, 256, 16),
                          (1, 5, 16, 4)])  # 5 heads: sub-groups 4 + 1; 4-slot pages
def test_native_equals_the_xla_formulation(kv_heads, group, head_dim, page_size) -> None:
    n, attend = _case(kv_heads, group, head_dim, page_size)
    idx = np.arange(n)
    want, got = attend(XLA, idx), attend(NATIVE, idx)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_native_rows_are_bitwise_invariant() -> None:
    """A row's bits do not depend on the step's size, its place in the step, the other rows
    (decode rows of other sequences, a prefill run of its own sequence) or the layer
    argument being a constant or traced."""
    n, attend = _case(3, 3, 64, 16, seed=1)
    full = attend(NATIVE, np.arange(n))
    rng = np.random.default_rng(2)
    for size in (1, 2, 3, 7, 16, 33, n):
        for idx in (np.arange(size), np.arange(n - size, n), rng.permutation(n)[:size]):
            assert np.array_equal(attend(NATIVE, idx), full[idx]), (size, idx[:5])
    lone = np.stack([attend(NATIVE, np.array([i]))[0] for i in range(n - 24, n)])
    assert np.array_equal(lone, full[n - 24:])


def test_native_layer_index_selects_the_layer() -> None:
    n, attend = _case(2, 2, 64, 16, seed=3)
    idx = np.arange(n)
    for layer in (0, 2):
        np.testing.assert_allclose(attend(NATIVE, idx, layer), attend(XLA, idx, layer),
                                   rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("k,n", [(64, 128), (37, 100), (576, 192), (1536, 576)])
def test_row_gemm_equals_the_product_and_is_row_invariant(k, n) -> None:
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    x = jnp.asarray(rng.standard_normal((200, k)), jnp.float32)
    panels = native_kernels.pack_panels(w)
    assert panels.shape == (-(-n // 64), k, 64)
    gemm = jax.jit(lambda a, p: native_kernels.row_gemm(a, p, n))
    full = np.asarray(gemm(x, panels))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(full, want, rtol=1e-4, atol=1e-4)
    for m in (1, 2, 3, 4, 5, 17, 64, 199):
        for idx in (np.arange(m), np.arange(200 - m, 200), rng.permutation(200)[:m]):
            assert np.array_equal(np.asarray(gemm(x[idx], panels)), full[idx]), (m, idx[:4])


def test_calibration_chooses_native_where_it_runs_and_xla_where_it_cannot(monkeypatch) -> None:
    workload = workload_for(TINY_LLAMA, (1, 4, 16), (1, 4), 4, 16, 16, np.float32,
                            engine_defaults=False)
    device = jax.devices()[0]

    def kernels(plan) -> set[str]:
        return {f.kernel for p in plan.products for _, f in p.by_rows}

    cal = calibrate(workload, device, use_cache=False)
    assert cal.plan.verified and cal.plan.attention.kernel == "native"
    # the native product is a candidate at every size, invariant (whether its class is the
    # cheapest is the probe's timing, not asserted here)
    native = [r for r in cal.table if r["primitive"] == "product" and r["kernel"] == "native"]
    assert {r["rows"] for r in native} >= {1, 4, 16} and all(r["position_invariant"]
                                                             for r in native)
    # where they cannot build (no compiler, a failed build): XLA's formulations, verified
    monkeypatch.setitem(native_kernels._STATE, "error", "no C++ compiler (test)")
    plan = calibrate(workload, device, use_cache=False).plan
    assert plan.verified and plan.attention.kernel == "xla" and "native" not in kernels(plan)
    # operands split over a tensor-parallel group: never a native kernel
    monkeypatch.setitem(native_kernels._STATE, "error", None)
    sharded = workload_for(TINY_LLAMA, (1, 4, 16), (1, 4), 4, 16, 16, np.float32, tp=2,
                           engine_defaults=False)
    plan = calibrate(sharded, device, use_cache=False).plan
    assert plan.attention.kernel == "xla" and "native" not in kernels(plan)


@pytest.mark.parametrize("qwen2", [False, True])
def test_fused_layer_products_give_the_separate_products_bits(qwen2: bool) -> None:
    """Where the plan runs q/k/v (gate/up) natively alike at every step size, the compute
    params hold one panel stack per group and the decoder makes one product of it: hidden
    states and K/V bitwise those of the separate products, at every size, with widths that
    are no multiple of the 64-column panel (the members' columns start at panel bounds) and
    with biases (qwen2)."""
    from multiserve.config import ModelConfig
    from multiserve.model.layers.kv_pool import make_kv_pool
    from multiserve.model.families.llama import forward_hidden, fused_groups, plan_kernels
    from multiserve.model.loading.param_layout import init_random_params
    from multiserve.model.invariance.primitives import with_transposed

    cfg = ModelConfig(architecture="qwen2" if qwen2 else "llama", vocab_size=300,
                      hidden_size=80, intermediate_size=100, num_layers=2, num_heads=5,
                      num_kv_heads=1, head_dim=16, attention_bias=qwen2,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    sizes = (1, 8, 64)
    calibrated = calibrate(workload_for(cfg, sizes, (1,), 1, 16, 32, np.float32,
                                        engine_defaults=False), jax.devices()[0]).plan
    native = products_on(calibrated, "native")
    assert fused_groups(native, sizes) == ("wqkv", "w_gateup")
    params = jax.device_put(init_random_params(cfg, seed=5))
    fused = with_transposed(params, cfg, kernels=plan_kernels(native),
                            fused=fused_groups(native, sizes))
    apart = with_transposed(params, cfg, kernels=plan_kernels(native))
    assert {"wqkv_p", "w_gateup_p"} <= set(fused["stacked_layers"])
    assert not {"wq_p", "wk_p", "wv_p", "w_gate_p", "w_up_p"} & set(fused["stacked_layers"])
    run = jax.jit(lambda p, kv, b: forward_hidden(p, kv, b, cfg, page_size=16,
                                                  attn_block_size=32, plan=native))
    for t in sizes:
        rng = np.random.default_rng(t)
        batch = ForwardBatch(
            input_ids=jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32),
            positions=jnp.arange(t, dtype=jnp.int32), token_seq=jnp.zeros(t, jnp.int32),
            out_slots=jnp.arange(16, 16 + t, dtype=jnp.int32),
            page_table=jnp.arange(1, 9, dtype=jnp.int32)[None], seq_lens=jnp.full(1, t, jnp.int32),
            logit_rows=jnp.full(1, t - 1, jnp.int32))
        (h1, kv1), (h2, kv2) = (run(p, make_kv_pool(cfg, 16, 16, jnp.float32), batch)
                                for p in (fused, apart))
        assert np.array_equal(np.asarray(h1), np.asarray(h2)), t
        assert np.array_equal(np.asarray(kv1.k), np.asarray(kv2.k)), t
        assert np.array_equal(np.asarray(kv1.v), np.asarray(kv2.v)), t


def test_a_failed_build_says_why_and_leaves_no_files(tmp_path, monkeypatch) -> None:
    cxx = native_kernels._compiler()  # noqa: SLF001 - the build itself is under test
    if cxx is None:
        pytest.skip("no C++ compiler")
    # a source that compiles beside one that does not (not the real kernels: their -O3
    # compiles cost ~20 s of both cores and add nothing to what is checked here)
    fine = tmp_path / "fine.cc"
    fine.write_text("int g() { return 1; }\n")
    broken = tmp_path / "broken.cc"
    broken.write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(native_kernels, "SOURCES", (fine, broken))
    out = tmp_path / "kernels" / "k.so"
    out.parent.mkdir()
    with pytest.raises(RuntimeError, match="undeclared_name"):
        native_kernels._compile_to(cxx, out)  # noqa: SLF001
    assert list(out.parent.iterdir()) == []  # no .so, no objects, no temporaries


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpack_panels_is_the_exact_inverse_of_pack_panels(dtype: str) -> None:
    """unpack_panels(pack_panels(W)) is W bit for bit (any finite bit pattern: signed
    zeros, subnormals; weights are never NaN or inf, a weight update refuses them), stacked
    or not, with an odd K and an N that is no multiple of the 64-column panel (the padding
    is dropped)."""
    bits = jnp.uint32 if dtype == "float32" else jnp.uint16
    exponent = 0x7F800000 if dtype == "float32" else 0x7F80  # all ones: NaN or inf
    rng = np.random.default_rng(7)
    for shape in [(37, 100), (3, 64, 128), (2, 5, 129)]:
        raw = rng.integers(0, exponent << 1, shape, dtype=np.uint64)
        raw = np.where(raw & exponent == exponent, raw ^ exponent, raw)  # finite only
        w = jnp.asarray(raw.astype(np.dtype(bits.dtype))).view(jnp.dtype(dtype))
        k, n = shape[-2:]
        back = native_kernels.unpack_panels(native_kernels.pack_panels(w), k, n)
        assert back.shape == w.shape and back.dtype == w.dtype
        assert np.array_equal(np.asarray(back.view(bits)), np.asarray(w.view(bits))), shape
