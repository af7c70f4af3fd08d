"""The TPU's grouped matmul for a MoE layer's experts (kernels/grouped_tpu.py: JAX's
megablox `gmm`, pinned tiles), as `primitives.grouped` runs it ("gmm"), in Pallas
interpret mode on the CPU: against the "gather" formulation (each row against its gathered
expert matrix; float32: 1e-5, reassociation only; bfloat16 operands: 2e-2), and bitwise
row invariant: each row's bits are the same alone, in a batch of another size (another
number of row tiles, its tile shared with other experts' rows) and placed elsewhere among
its expert's rows. Its compile for a TPU: tests/test_doctor_compile.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.plan import Formulation, ProductPlan
from multiserve.model.invariance.primitives import grouped

E, K, N = 4, 192, 160  # K and N: a whole tile and a part of one


def _run(kernel: str, x: np.ndarray, experts: np.ndarray, w: jax.Array) -> np.ndarray:
    """Each row of x against its expert's matrix, the rows sorted by expert as the MoE
    layer sorts them, results back in the given order."""
    m = len(experts)
    plan = ProductPlan("we", K, N, ((m, Formulation(kernel, m)),))
    order = np.argsort(experts, kind="stable")
    ys = np.asarray(jax.jit(lambda a, g, b: grouped(a, g, b, None, plan, 0))(
        jnp.asarray(x[order]), jnp.asarray(experts[order], jnp.int32), w))
    out = np.empty_like(ys)
    out[order] = ys
    return out


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_matches_the_gather_formulation(dtype: str, tol: float) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((21, K)).astype(np.float32)
    experts = rng.integers(0, E, 21).astype(np.int32)
    experts[:3] = 2  # an expert with several rows, one with none below
    experts[experts == 1] = 3
    w = jnp.asarray(rng.standard_normal((E, K, N)) / np.sqrt(K), dtype)
    xs = np.asarray(jnp.asarray(x, dtype))
    got, want = _run("gmm", xs, experts, w), _run("gather", xs, experts, w)
    assert got.dtype == want.dtype and got.shape == (21, N)
    assert float(np.max(np.abs(got.astype(np.float32) - want.astype(np.float32)))) <= tol


def test_rows_are_bitwise_invariant() -> None:
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((30, K)), jnp.bfloat16)
    xs = np.asarray(x)
    experts = rng.integers(0, E, 30).astype(np.int32)
    w = jnp.asarray(rng.standard_normal((E, K, N)) / np.sqrt(K), jnp.bfloat16)
    full = _run("gmm", xs, experts, w)
    for rows in (np.array([5]), np.arange(9), np.arange(13, 30), rng.permutation(30)[:17]):
        np.testing.assert_array_equal(_run("gmm", xs[rows], experts[rows], w), full[rows])
