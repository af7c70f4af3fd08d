"""The native LoRA delta kernel (model/kernels/src/lora_delta.cc): what the XLA form of
model/layers/lora.py computes (float32 tolerance; bfloat16 operands widened), zero rows for
slot 0, the layer read in place, and a token's delta the same bits whatever the step's
size and whatever slots the other tokens use (float32 and bfloat16, vector and scalar
ranks, an odd K)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.kernels import native
from multiserve.model.layers.lora import lora_delta


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine uses the XLA formulation")
    assert native.unavailable_reason() is None


def _case(dtype: jnp.dtype, rank: int, tokens: int = 37, k: int = 96, n: int = 200,
          layers: int = 3, slots: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((layers, slots, k, rank), np.float32) / np.sqrt(k)
    b = rng.standard_normal((layers, slots, rank, n), np.float32)
    a[:, 0] = 0.0
    b[:, 0] = 0.0
    scale = np.array([0.0, 2.0, 0.5, 1.0, 4.0], np.float32)[:slots]
    x = rng.standard_normal((tokens, k), np.float32)
    s = rng.integers(0, slots, tokens).astype(np.int32)
    return (jnp.asarray(x, dtype), jnp.asarray(a, dtype), jnp.asarray(b, dtype),
            jnp.asarray(scale), jnp.asarray(s))


@pytest.mark.parametrize("dtype,rank,k", [(jnp.float32, 16, 96), (jnp.float32, 12, 96),
                                          (jnp.bfloat16, 16, 96), (jnp.bfloat16, 32, 96),
                                          (jnp.bfloat16, 12, 103)])
def test_native_delta_matches_the_xla_form_and_is_row_invariant(dtype: jnp.dtype,
                                                               rank: int, k: int) -> None:
    """(bfloat16, rank 12, K 103: the pair sums' partial rank vector, the pairs left over
    after four equal chains and an odd K's last element)"""
    x, a, b, scale, slots = _case(dtype, rank, k=k)
    call = jax.jit(native.lora_delta_native)
    for layer in (0, 2):
        got = np.asarray(call(x, a, b, scale, slots, layer))
        want = np.asarray(jax.jit(lora_delta)(x, a[layer], b[layer], scale, slots))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        assert not got[np.asarray(slots) == 0].any()  # slot 0: no adapter, a zero row
        assert got[np.asarray(slots) > 0].any()
        # each token alone, and the whole step with every other token's slot changed:
        # the same bits
        for t in (0, 5, 36):
            alone = np.asarray(call(x[t:t + 1], a, b, scale, slots[t:t + 1], layer))
            np.testing.assert_array_equal(alone[0], got[t])
        other = jnp.where(jnp.arange(x.shape[0]) % 2 == 0, slots, (slots + 1) % 5)
        mixed = np.asarray(call(x, a, b, scale, other.astype(jnp.int32), layer))
        keep = np.arange(x.shape[0]) % 2 == 0
        np.testing.assert_array_equal(mixed[keep], got[keep])
        np.testing.assert_array_equal(np.asarray(call(x[:8], a, b, scale, slots[:8], layer)),
                                      got[:8])


@pytest.mark.parametrize("dtype,rank", [(jnp.float32, 16), (jnp.bfloat16, 16),
                                        (jnp.float32, 12)])
def test_applied_form_adds_each_delta_once_and_leaves_base_rows(dtype: jnp.dtype,
                                                                rank: int) -> None:
    """`lora_apply_native` on two projections of one x (N 200 and 64) in one output row
    of 280 columns (at 0 and 208, as a fused product's members): a token with an adapter
    gets round(y + d) in each projection's columns (d the delta form's float32 bits), a
    slot-0 token and the columns no projection covers y's own bits; each token alone =
    in the step."""
    x, a, b, scale, slots = _case(dtype, rank)
    _, a2, b2, _, _ = _case(dtype, rank, n=64, seed=1)
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.standard_normal((x.shape[0], 280)), dtype)
    offsets = (0, 208)
    apply = jax.jit(native.lora_apply_native, static_argnums=(4,))
    delta = jax.jit(native.lora_delta_native)
    layer = 1
    got = np.asarray(apply(x, y, (a, a2), (b, b2), offsets, scale, slots, layer))
    on = np.asarray(slots) > 0
    covered = np.zeros(280, bool)
    for am, bm, start in zip((a, a2), (b, b2), offsets, strict=True):
        cols = slice(start, start + bm.shape[-1])
        covered[cols] = True
        part = y[:, cols]
        d = delta(x, am, bm, scale, slots, layer)
        want = np.asarray((part.astype(jnp.float32) + d).astype(dtype))
        np.testing.assert_array_equal(got[on, cols], want[on])
        assert not np.array_equal(got[on, cols], np.asarray(part)[on])
    np.testing.assert_array_equal(got[~on], np.asarray(y)[~on])
    np.testing.assert_array_equal(got[:, ~covered], np.asarray(y)[:, ~covered])
    for t in (0, 5, 36):
        alone = apply(x[t:t + 1], y[t:t + 1], (a, a2), (b, b2), offsets, scale,
                      slots[t:t + 1], layer)
        np.testing.assert_array_equal(np.asarray(alone)[0], got[t])


@pytest.mark.parametrize("dtype,path", [(jnp.float32, None), (jnp.bfloat16, "avx512_bf16"),
                                        (jnp.bfloat16, "widen"), (jnp.bfloat16, "amx")])
def test_product_with_the_delta_in_its_epilogue_is_product_then_apply(dtype: jnp.dtype,
                                                                     path: str | None) -> None:
    """`row_gemm_lora` at one row (src/row_gemm_lora.cc) = `row_gemm` then
    `lora_apply_native`, bit for bit: three members at panel-aligned offsets as q|k|v (N 130,
    64 and 40: partial panels; the second slot's adapter of rank 12 in rank-16 stacks; odd
    K) without a residual, and one member over the whole output with a residual (o, down);
    a slot-0 row gets the product's own bits. K is large enough that the product's panels
    spread over the pool's threads (product_split.h), as the engine's layer matrices."""
    if path is not None and path not in native.bf16_paths_available():
        pytest.skip(f"the {path} path does not run on this CPU")
    k, widths, layers, slots_n = 1601, (130, 64, 40), 2, 3
    rng = np.random.default_rng(7)
    offsets = (0, 192, 256)
    n = offsets[-1] + widths[-1]
    a = [rng.standard_normal((layers, slots_n, k, 16), np.float32) / np.sqrt(k)
         for _ in widths]
    b = [rng.standard_normal((layers, slots_n, 16, w), np.float32) for w in widths]
    for am, bm in zip(a, b, strict=True):
        am[:, 0], bm[:, 0] = 0.0, 0.0
        am[:, 2, :, 12:], bm[:, 2, 12:] = 0.0, 0.0  # slot 2: an adapter of rank 12
    a = tuple(jnp.asarray(v, dtype) for v in a)
    b = tuple(jnp.asarray(v, dtype) for v in b)
    scale = jnp.asarray([0.0, 2.0, 0.75], jnp.float32)
    w = jnp.asarray(rng.standard_normal((layers, k, n), np.float32) / np.sqrt(k), dtype)
    panels = jax.vmap(native.pack_panels)(w)
    x = jnp.asarray(rng.standard_normal((1, k)), dtype)
    res_whole = jnp.asarray(rng.standard_normal((1, n)), dtype)

    @jax.jit
    def separate(x, slots, res, layer):
        y = native.row_gemm(x, panels, n, layer, path=path,
                            residual=res if dtype == jnp.bfloat16 else None)
        if res is not None and dtype == jnp.float32:
            y = res + y  # the float32 product's residual, as primitives.product adds it
        members = (0, 1, 2) if res is None else (1,)
        return native.lora_apply_native(
            x, y, tuple(a[i] for i in members), tuple(b[i] for i in members),
            offsets if res is None else (offsets[1],), scale, slots, layer)

    @jax.jit
    def fused(x, slots, res, layer):
        members = (0, 1, 2) if res is None else (1,)
        return native.row_gemm_lora(
            x, panels, n, layer, tuple(a[i] for i in members),
            tuple(b[i] for i in members), offsets if res is None else (offsets[1],),
            scale, slots, residual=res, path=path)

    for res in (None, res_whole):
        plain = native.row_gemm(x, panels, n, 1, path=path)
        for slot in (0, 1, 2):
            s = jnp.asarray([slot], jnp.int32)
            want = np.asarray(separate(x, s, res, 1))
            got = np.asarray(fused(x, s, res, 1))
            np.testing.assert_array_equal(got, want)
            if slot == 0 and res is None:
                np.testing.assert_array_equal(got, np.asarray(plain))
            if slot > 0:  # the deltas are there
                assert not np.array_equal(got, np.asarray(separate(x, s * 0, res, 1)))
