"""The AMX path of the native bfloat16 product (src/amx_panel.h, row_gemm_bf16.cc kAmx):
its bits are the sums amx_panel.h states (per block of 16 pairs of k, the even products
and the odd products each summed in order from zero, then added to the block's running
sum as C + (E + O)), computed here in numpy in that order, for every K the blocking can
meet (a multiple of 32, a short last block, an odd K, K below one block) and row counts
within one tile block and across several; and a row's bits are the same wherever it
sits and whatever shares its tile. Runs only where this CPU and kernel grant AMX-BF16
tiles (`amx` in native.bf16_paths_available()); elsewhere each test says it was skipped
and why. (test_native_kernels_bf16.py runs its row-invariance, grouped and residual tests
on this path too, where it runs.)"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from multiserve.model.kernels import native


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: no native kernels")
    assert native.unavailable_reason("bfloat16") is None
    if "amx" not in native.bf16_paths_available():
        pytest.skip("this CPU (or its kernel) grants no AMX-BF16 tiles: the AMX path is not "
                    f"built or not run here (paths here: {native.bf16_paths_available()})")


def tile_sums(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 [M, N]: amx_panel.h's sums of x [M, K] @ w [K, N] (bfloat16 values, held as
    float32), in its order. Each product of two bfloat16 is exact in float32, so every
    float32 add below is the instruction's one rounding."""
    m, k = x.shape
    if k % 2:  # an odd K's last pair is (x[K - 1], 0) against (W[K - 1], 0)
        x, w = np.pad(x, ((0, 0), (0, 1))), np.pad(w, ((0, 1), (0, 0)))
    pairs = x.shape[1] // 2
    c = np.zeros((m, w.shape[1]), np.float32)
    for b0 in range(0, pairs, 16):
        e = np.zeros_like(c)
        o = np.zeros_like(c)
        for p in range(b0, min(b0 + 16, pairs)):
            e = e + x[:, 2 * p, None] * w[None, 2 * p]
            o = o + x[:, 2 * p + 1, None] * w[None, 2 * p + 1]
        c = c + (e + o)
    return c


def _case(m: int, k: int, n: int, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (5, 577, 130), (16, 64, 64),
                                   (17, 37, 100), (37, 1601, 200), (3, 20, 70)])
def test_amx_bits_are_the_tile_sums_in_their_order(m: int, k: int, n: int) -> None:
    """576: whole blocks; 577: odd, one pair in the last block; 37: a 3-pair last block;
    1601: odd over many blocks; 20: less than one block. float32 out is the sums' bits;
    bfloat16 out their round to nearest even."""
    x, w = _case(m, k, n, m * k + n)
    want = tile_sums(np.asarray(x, np.float32), np.asarray(w, np.float32))
    panels = native.pack_panels(w)
    got = np.asarray(jax.jit(lambda a, p: native.row_gemm(
        a, p, n, out_dtype=jnp.float32, path="amx"))(x, panels))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    got16 = np.asarray(jax.jit(lambda a, p: native.row_gemm(a, p, n, path="amx"))(x, panels))
    np.testing.assert_array_equal(got16.view(np.uint16),
                                  want.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_a_row_is_the_same_bits_in_any_tile_and_position() -> None:
    """Rows alone, in tiles of 2..16 rows, at the front, the middle and the end of a tile,
    and over several tiles: one row's bits each time (the tile's rows never mix)."""
    k, n = 1601, 136
    x, w = _case(48, k, n, 3)
    panels = native.pack_panels(w)
    gemm = jax.jit(lambda a, p: native.row_gemm(a, p, n, out_dtype=jnp.float32, path="amx"))
    full = np.asarray(gemm(x, panels))
    rng = np.random.default_rng(0)
    for m in (1, 2, 7, 15, 16, 17, 33):
        idx = rng.permutation(48)[:m]
        np.testing.assert_array_equal(np.asarray(gemm(x[idx], panels)), full[idx])
    for r in (0, 15, 16, 47):
        np.testing.assert_array_equal(np.asarray(gemm(x[r:r + 1], panels))[0], full[r])


def test_the_amx_path_differs_from_the_other_paths_and_agrees_in_value() -> None:
    """Its own bits (another summation order), within float32 rounding of the exact sum."""
    x, w = _case(8, 1601, 64, 5)
    panels = native.pack_panels(w)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    outs = {path: np.asarray(native.row_gemm(x, panels, 64, out_dtype=jnp.float32, path=path))
            for path in native.bf16_paths_available()}
    for path, out in outs.items():
        np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4, err_msg=path)
    assert not np.array_equal(outs["amx"], outs["widen"])
