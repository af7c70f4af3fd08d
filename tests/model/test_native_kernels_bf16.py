"""The native kernels in bfloat16 (row_gemm_bf16.cc, paged_attention.cc over a bf16 pool):
bf16 weights packed without rounding, products and attention bitwise row-invariant on every
instruction path this CPU runs, accurate against a float64 reference within stated bounds,
the widening path giving exactly the float32 product's bits on the widened operands, and
attention over a bf16 pool the float32 kernel's result on the widened pool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.forward_batch import ForwardBatch

ROWS = 70  # every row count 1..ROWS is checked
# Accuracy bound of a float32-accumulated product of exactly representable bf16 operands:
# |y - x @ W| <= REL_SUM * (|x| @ |W|) per element (float32 accumulation over K <= 1536
# measured ~1e-7 of the magnitude sum; the bound leaves 100x).
REL_SUM = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine uses the XLA formulation")
    assert native_kernels.unavailable_reason("bfloat16") is None


@pytest.fixture(params=native_kernels.BF16_PATHS)
def path(request) -> str:
    """Each bf16 product path, skipped where this CPU lacks it."""
    if request.param not in native_kernels.bf16_paths_available():
        pytest.skip(f"this CPU does not run the {request.param} path")
    return request.param


def _operands(k: int, n: int, rows: int, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    return x, w


def _f64(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32), np.float64)


def test_pack_panels_bf16_keeps_the_bits_in_k_pairs() -> None:
    k, n = 37, 100
    _, w = _operands(k, n, 1, 0)
    panels = np.asarray(native_kernels.pack_panels(w).view(jnp.uint16))
    assert panels.shape == (2, 19, 128)
    bits = np.asarray(w.view(jnp.uint16))
    for p, j, c, e in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 35, 1), (0, 18, 63, 0)]:
        assert panels[p, j, 2 * c + e] == bits[2 * j + e, 64 * p + c]
    assert not panels[:, 18, 1::2].any()  # odd K: the last pair's high half is zero
    assert not panels[1, :, 2 * (n - 64):].any()  # columns past N are zero


def test_bf16_unavailable_reason_names_the_dtype() -> None:
    assert native_kernels.unavailable_reason("bfloat16") is None
    assert "float16" in native_kernels.unavailable_reason("float16")
    assert native_kernels.bf16_product_path() in native_kernels.BF16_PATHS
    assert "widen" in native_kernels.bf16_paths_available()


@pytest.mark.parametrize("k,n", [(576, 192), (37, 100)])
def test_bf16_product_is_bitwise_row_invariant_at_every_row_count(path, k, n) -> None:
    """Each row's bits, float32 and bfloat16 out, are the same at every row count 1..70,
    wherever the row sits in the product."""
    x, w = _operands(k, n, ROWS, k + n)
    panels = native_kernels.pack_panels(w)
    gemm = jax.jit(lambda a, p: native_kernels.row_gemm(a, p, n, out_dtype=jnp.float32,
                                                        path=path))
    full = np.asarray(gemm(x, panels))
    rng = np.random.default_rng(1)
    # every count up to two 6-row register blocks and past them, then the counts around
    # the thread split and the bucket edges (each count is one more compile)
    for m in [*range(1, 15), 17, 31, 32, 33, 63, 64, 65, ROWS]:
        assert np.array_equal(np.asarray(gemm(x[:m], panels)), full[:m]), m
        idx = rng.permutation(ROWS)[:m]
        assert np.array_equal(np.asarray(gemm(x[idx], panels)), full[idx]), (m, idx[:4])
    gemm16 = jax.jit(lambda a, p: native_kernels.row_gemm(a, p, n, path=path))
    full16 = np.asarray(gemm16(x, panels).view(jnp.uint16))
    for m in (1, 5, 6, 7, 13, 64):
        assert np.array_equal(np.asarray(gemm16(x[ROWS - m:], panels).view(jnp.uint16)),
                              full16[ROWS - m:]), m


@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (37, 100)])
def test_bf16_product_accuracy_against_float64(path, k, n) -> None:
    x, w = _operands(k, n, 17, k * n)
    want = _f64(x) @ _f64(w)
    bound = REL_SUM * (np.abs(_f64(x)) @ np.abs(_f64(w)))
    got = np.asarray(native_kernels.row_gemm(x, native_kernels.pack_panels(w), n,
                                             out_dtype=jnp.float32, path=path), np.float64)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    # bfloat16 out: the float32 sum rounded once, to nearest even (ml_dtypes' rounding)
    got16 = native_kernels.row_gemm(x, native_kernels.pack_panels(w), n, path=path)
    assert got16.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got16.view(jnp.uint16)),
                          np.asarray(jnp.asarray(got, jnp.float32).astype(jnp.bfloat16)
                                     .view(jnp.uint16)))


@pytest.mark.parametrize("k,n", [(576, 192), (37, 100)])
def test_widening_path_gives_the_float32_kernels_bits(k, n) -> None:
    """bf16 x or float32 x against bf16 panels on the widening path: exactly the float32
    kernel on the widened operands (one FMA per k in order, the same sum)."""
    x, w = _operands(k, n, 23, 7)
    want = np.asarray(native_kernels.row_gemm(x.astype(jnp.float32),
                                              native_kernels.pack_panels(w.astype(jnp.float32)),
                                              n))
    panels = native_kernels.pack_panels(w)
    for xs in (x, x.astype(jnp.float32)):
        got = native_kernels.row_gemm(xs, panels, n, out_dtype=jnp.float32, path="widen")
        assert np.array_equal(np.asarray(got), want), xs.dtype
    # a float32 x always widens, whatever path is asked
    got = native_kernels.row_gemm(x.astype(jnp.float32) + 0.25, panels, n,
                                  path=native_kernels.BF16_PATHS[0])
    assert got.dtype == jnp.float32
    assert np.array_equal(np.asarray(got), np.asarray(native_kernels.row_gemm(
        x.astype(jnp.float32) + 0.25, panels, n, path="widen")))


def test_bf16_layer_stack_reads_the_chosen_layer(path) -> None:
    k, n, layers = 64, 130, 3
    rng = np.random.default_rng(4)
    ws = jnp.asarray(rng.standard_normal((layers, k, n)) / 8, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((9, k)), jnp.bfloat16)
    stack = native_kernels.pack_panels(ws)
    gemm = jax.jit(lambda a, p, lay: native_kernels.row_gemm(a, p, n, lay,
                                                             out_dtype=jnp.float32, path=path))
    for layer in range(layers):
        alone = native_kernels.row_gemm(x, native_kernels.pack_panels(ws[layer]), n,
                                        out_dtype=jnp.float32, path=path)
        assert np.array_equal(np.asarray(gemm(x, stack, jnp.int32(layer))), np.asarray(alone))


@pytest.mark.parametrize("k,n", [(576, 576), (37, 100)])
def test_residual_epilogue_gives_the_bits_of_the_add_done_apart(path, k, n) -> None:
    """row_gemm(x, W, residual=r) == r + row_gemm(x, W) in bfloat16 (XLA's add: both
    widened, one float32 add, one rounding) bitwise, at every row count, from a layer of a
    stack, with a residual large and small against the product (the add rounds either way),
    N a multiple of the panel width or not."""
    layers, rows = 2, 13
    rng = np.random.default_rng(7)
    ws = jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    scale = np.where(rng.random((rows, n)) < 0.5, 64.0, 1 / 64)
    res = jnp.asarray(rng.standard_normal((rows, n)) * scale, jnp.bfloat16)
    stack = native_kernels.pack_panels(ws)
    fused = jax.jit(lambda a, r, lay: native_kernels.row_gemm(
        a, stack, n, lay, out_dtype=jnp.bfloat16, path=path, residual=r))
    apart = jax.jit(lambda a, r, lay: r + native_kernels.row_gemm(
        a, stack, n, lay, out_dtype=jnp.bfloat16, path=path))
    for layer in range(layers):
        for m in (1, 2, 6, 7, rows):
            got = np.asarray(fused(x[:m], res[:m], jnp.int32(layer)))
            want = np.asarray(apart(x[:m], res[:m], jnp.int32(layer)))
            assert got.dtype == want.dtype == jnp.bfloat16
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (layer, m)
            if m == rows:  # the rows of a batch are the rows alone
                one = np.asarray(fused(x[3:4], res[3:4], jnp.int32(layer)))
                assert np.array_equal(one.view(np.uint16), got[3:4].view(np.uint16))


def test_residual_of_the_wrong_shape_or_dtype_is_refused(path) -> None:
    k, n = 64, 128
    x, w = _operands(k, n, 3, 8)
    panels = native_kernels.pack_panels(w)[None]
    with pytest.raises(AssertionError):  # the product's float32 output takes no residual
        native_kernels.row_gemm(x, panels, n, 0, out_dtype=jnp.float32, path=path,
                                residual=jnp.zeros((3, n), jnp.bfloat16))
    with pytest.raises(AssertionError):
        native_kernels.row_gemm(x, panels, n, 0, out_dtype=jnp.bfloat16, path=path,
                                residual=jnp.zeros((2, n), jnp.bfloat16))
    # the kernel's own check, past the wrapper: a residual of another shape
    bad = jax.ffi.ffi_call(native_kernels.ROW_GEMM_BF16_RESIDUAL,
                           jax.ShapeDtypeStruct((3, n), jnp.bfloat16))
    with pytest.raises(Exception, match="res of y's shape"):
        np.asarray(bad(x, panels, jnp.int32(0), jnp.zeros((3, n - 64), jnp.bfloat16),
                       path=np.int64(native_kernels.BF16_PATHS.index(path))))


def test_bf16_grouped_rows_depend_only_on_their_own_group(path) -> None:
    """A row of the grouped product has the bits of the dense product of its group's matrix
    alone, however many rows chose that group and wherever its group starts."""
    k, n, groups = 96, 136, 4
    rng = np.random.default_rng(5)
    ws = jnp.asarray(rng.standard_normal((groups, k, n)) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((31, k)), jnp.bfloat16)
    g = np.sort(rng.integers(0, groups, 31)).astype(np.int32)
    stack = native_kernels.pack_panels(ws)
    got = np.asarray(native_kernels.grouped_row_gemm(x, stack, jnp.asarray(g), n,
                                                     out_dtype=jnp.float32, path=path))
    for e in range(groups):
        rows = np.flatnonzero(g == e)
        if rows.size == 0:
            continue
        alone = native_kernels.row_gemm(x[rows], native_kernels.pack_panels(ws[e]), n,
                                        out_dtype=jnp.float32, path=path)
        assert np.array_equal(got[rows], np.asarray(alone)), e
        for r in rows[:3]:
            one = native_kernels.grouped_row_gemm(x[r:r + 1], stack, jnp.asarray(g[r:r + 1]), n,
                                                  out_dtype=jnp.float32, path=path)
            assert np.array_equal(np.asarray(one)[0], got[r]), (e, r)


def test_a_path_this_cpu_lacks_is_refused() -> None:
    x, w = _operands(64, 64, 2, 9)
    with pytest.raises(RuntimeError, match="does not run here"):
        native_kernels.row_gemm(x, native_kernels.pack_panels(w), 64, path="sse2")


def test_the_environment_forces_the_one_path_a_calibration_may_choose() -> None:
    """MULTISERVE_BF16_PATH=widen: the calibration's only candidate and the default; a
    name this CPU does not run is ignored (every available path stays a candidate)."""
    code = ("from multiserve.model.kernels import native as n; n.unavailable_reason(); "
            "print(n.bf16_product_path(), ','.join(n.bf16_path_candidates()))")
    for forced, want in (("widen", "widen widen"),
                         ("sse2", f"{native_kernels.bf16_product_path()} "
                                  f"{','.join(native_kernels.bf16_paths_available())}")):
        env = {**os.environ, native_kernels.BF16_PATH_ENV: forced}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True, timeout=300)
        assert done.stdout.strip().splitlines()[-1] == want, forced


def _attention_case(kv_heads: int, group: int, head_dim: int, page_size: int, seed: int):
    """16 sequences in a shuffled page table over a bf16 pool; 40 decode rows at positions up
    to ~300 and a 24-token prefill run of one sequence."""
    rng = np.random.default_rng(seed)
    num_seqs, max_pages = 16, -(-320 // page_size)
    slots = (1 + num_seqs * max_pages) * page_size
    pool = (3, kv_heads, slots, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(pool), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal(pool), jnp.bfloat16)
    table = jnp.asarray((1 + rng.permutation(num_seqs * max_pages)).reshape(num_seqs, -1)
                        .astype(np.int32))
    seq = np.concatenate([rng.integers(0, num_seqs - 1, 40), np.full(24, num_seqs - 1)])
    pos = np.concatenate([rng.integers(0, 300, 40), 150 + np.arange(24)])
    q = jnp.asarray(rng.standard_normal((len(seq), kv_heads * group, head_dim)), jnp.float32)
    fn = jax.jit(lambda qs, kp, vp, b: native_kernels.paged_attention_native(
        qs, kp, vp, jnp.int32(1), b, page_size=page_size))

    def attend(idx: np.ndarray, qs: jax.Array | None = None, pools=(k_pool, v_pool)):
        n = len(idx)
        batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32),
                             positions=jnp.asarray(pos[idx], jnp.int32),
                             token_seq=jnp.asarray(seq[idx], jnp.int32),
                             out_slots=jnp.zeros(n, jnp.int32), page_table=table,
                             seq_lens=jnp.zeros(num_seqs, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        return np.asarray(fn(q[idx] if qs is None else qs[idx], *pools, batch))

    return len(seq), q, (k_pool, v_pool), attend


@pytest.mark.parametrize("kv_heads,group,head_dim,page_size",
                         [(3, 3, 64, 16), (2, 1, 32, 8), (1, 4, 128, 16), (2, 2, 16, 8)])
def test_bf16_pool_attention_computes_the_float32_kernels_result_on_the_widened_pool(
        kv_heads, group, head_dim, page_size) -> None:
    """The float32 kernel's arithmetic (that kernel is checked against the XLA
    formulation), at float32 tolerance: the bf16 kernel widens a row as its even and odd
    dims, so a score's lane partial sums add the same products in another grouping, and the
    bits may differ by an ulp."""
    n, q, (k_pool, v_pool), attend = _attention_case(kv_heads, group, head_dim, page_size, 0)
    idx = np.arange(n)
    wide = (k_pool.astype(jnp.float32), v_pool.astype(jnp.float32))
    np.testing.assert_allclose(attend(idx), attend(idx, pools=wide), rtol=2e-5, atol=2e-6)
    # q in bfloat16: the output in bfloat16, the float32 result of the widened q rounded once
    q16 = q.astype(jnp.bfloat16)
    got16 = attend(idx, q16)
    assert got16.dtype == jnp.bfloat16
    want16 = jnp.asarray(attend(idx, q16.astype(jnp.float32))).astype(jnp.bfloat16)
    assert np.array_equal(got16.view(np.uint16), np.asarray(want16.view(jnp.uint16)))


def test_bf16_pool_attention_rows_are_bitwise_invariant() -> None:
    """A row's bits do not depend on the step's size, its place in the step or the other
    rows (decode rows of other sequences, a prefill run of its own sequence)."""
    n, _, _, attend = _attention_case(3, 3, 64, 16, seed=1)
    full = attend(np.arange(n))
    rng = np.random.default_rng(2)
    for size in (1, 2, 3, 7, 16, 33, n):
        for idx in (np.arange(size), np.arange(n - size, n), rng.permutation(n)[:size]):
            assert np.array_equal(attend(idx), full[idx]), (size, idx[:5])
    lone = np.stack([attend(np.array([i]))[0] for i in range(n - 24, n)])
    assert np.array_equal(lone, full[n - 24:])
