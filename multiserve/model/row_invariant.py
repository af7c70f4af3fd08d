"""Row-invariant primitives: dense products (and the weight layouts they need) and row sums.

A token's numerics must not depend on how many other tokens share its step (the engine's
determinism rests on it), so every product x[M, K] @ W[K, N] and every sum over a row in
the model and the sampler must give each row bitwise the same value for every row count M
the engine runs (1 to the largest bucket).

Backend fact this relies on (XLA:CPU, jax 0.10.2, fp32, AVX2+FMA; guarded by
tests/model/test_row_invariance.py, which fails loudly when a JAX/XLA upgrade or another
backend changes it):
- the plain product `x @ W` (W stored [K, N]) gives one result for M == 1 (a GEMV) and for
  M >= 64, but other results for M in 2..48 (another kernel);
- the "NT" product `dot_general(x, Wt)` contracting x's dim 1 with Wt's dim 1 (Wt stored
  [N, K], i.e. W transposed in memory) gives, for EVERY M >= 2, bitwise the same rows as
  the plain product at M >= 64 and as the M == 1 GEMV (measured for every contraction of
  the Llama family at M in 1..512: 576x{192,576,960,1536,3072,49152}, 1536x576);
- the NT product at M == 1 is another kernel again (differs), hence the GEMV there;
- but the GEMV agrees only while K <= 2048 (GEMV_MAX_K; measured K in 1536..14336): a
  longer contraction is summed in another order, so one row with K > 2048 is padded to
  two and takes the NT product.
So `dense` uses the GEMV for one row (K <= 2048) and the NT product otherwise: all rows
agree with each other bit for bit at every M. The price is a second, transposed copy of
every matrix on the device (see `with_transposed`); on CPU it buys GEMV-speed single
streams and 2..48-row steps at their own size instead of padded to 64 rows.

Row sums: XLA:CPU's own reductions (jnp.sum / jnp.mean over the last axis) change their
summation order with the total size of the operand (measured: [M, 576] differs for M <= 5,
[M, 64] for M <= 32, [M, 16] for every M < 256), so a row's sum depends on how many rows
are reduced together. `row_sum` is an NT product with a block of ones, padded to >= 2 rows:
invariant at every M and width measured (16 to 49152). Max/min reductions are exact and
need nothing.

Measured cost on this machine (2 cores, ms, 576x1536): GEMV M=1 0.16; NT M=2 0.38,
M=8 0.31, M=64 0.90, M=512 5.7; plain M=64 0.90, M=512 6.9 (the NT form is not slower).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig

# the matrices of one layer that get a transposed copy ("<name>_t", [L, out, in])
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
NT = (((1,), (1,)), ((), ()))  # dot_general dims: x[M, K] . Wt[N, K] -> [M, N]
GEMV_MAX_K = 2048  # longest contraction whose M == 1 GEMV sums like the NT product
PLAIN_MIN_ROWS = 64  # from this row count on, the plain product sums like the NT product
ROW_SUM_COLUMNS = 8  # columns of ones in `row_sum` (a 1-column product is a GEMV: varies)


def dense(x: jax.Array, w: jax.Array, w_t: jax.Array | None,
          preferred: Any = None) -> jax.Array:
    """x [M, K] @ W -> [M, N] with each row bitwise independent of M.

    `w` is W [K, N], `w_t` the same matrix stored transposed [N, K]. M is static (a shape),
    so the choice of kernel is made at trace time. With `w_t` None (the scanned decoder of
    large steps, which has only the stacked W), M must be >= PLAIN_MIN_ROWS: there the
    plain product sums like the NT product (backend fact, module docstring)."""
    if x.shape[0] == 1 and x.shape[1] <= GEMV_MAX_K:
        return jnp.dot(x, w, preferred_element_type=preferred)
    if w_t is None:
        assert x.shape[0] >= PLAIN_MIN_ROWS, (x.shape, "needs W^T below PLAIN_MIN_ROWS rows")
        return jnp.dot(x, w, preferred_element_type=preferred)
    if x.shape[0] == 1:
        two = jnp.pad(x, ((0, 1), (0, 0)))  # the NT kernel at 2 rows: the same rows
        return jax.lax.dot_general(two, w_t, NT, preferred_element_type=preferred)[:1]
    return jax.lax.dot_general(x, w_t, NT, preferred_element_type=preferred)


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis of x [..., K] (f32), each row bitwise independent of how many
    rows x has. Leading axes are flattened into rows."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows < 2:  # the NT kernel at one row is another kernel
        flat = jnp.pad(flat, ((0, 2 - rows), (0, 0)))
    ones = jnp.ones((ROW_SUM_COLUMNS, x.shape[-1]), x.dtype)
    return jax.lax.dot_general(flat, ones, NT)[:rows, 0].reshape(x.shape[:-1])


def _transpose_last(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, -1, -2)


_transpose_tree = jax.jit(lambda tree: jax.tree.map(_transpose_last, tree))


@jax.jit
def _split_layers(layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """Stacked [L, ...] layer params -> one dict of separate arrays per layer."""
    num_layers = next(iter(layers.values())).shape[0]
    return tuple({name: a[i] for name, a in layers.items()} for i in range(num_layers))


def with_transposed(params: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The compute params the forward runs on, derived from the canonical pytree (matrices
    [in, out] stacked over layers, see param_layout):
    - `layers`: a TUPLE with one dict per layer, each matrix in both layouts (`<name>` W
      [in, out] for the one-row GEMV, `<name>_t` W^T [out, in] for the NT product) and the
      layer's norms/biases, each a separate device array. The forward unrolls the layers
      over this tuple: a layer reads its weights in place, where a scan over stacked arrays
      copies every layer's matrices out of the stack at every step (measured on XLA:CPU:
      a third of a one-token step).
    - `stacked_layers`: the canonical stacked layer arrays (shared, no copy), which the
      scanned decoder of large steps reads with the plain product (>= PLAIN_MIN_ROWS rows);
    - `embed`, `final_norm`: the canonical arrays (shared, no copy);
    - the output head in both layouts, `head_w` [D, V] and `head_wt` [V, D]; tied
      embeddings reuse `embed` as `head_wt` (no copy).
    Copies keep their source's sharding (minus the layer axis; transposed for `_t`)."""
    layers = params["layers"]
    to_transpose: dict[str, Any] = {name: layers[name] for name in LAYER_MATRICES}
    to_transpose["head"] = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    done = _transpose_tree(to_transpose)
    head = done.pop("head")
    out = {k: v for k, v in params.items() if k != "layers"}
    out["stacked_layers"] = layers  # the canonical arrays themselves (no copy)
    out["layers"] = _split_layers({**layers, **{f"{name}_t": a for name, a in done.items()}})
    for a in done.values():
        a.delete()  # the stacked transposes were only the source of the per-layer copies
    if cfg.tie_word_embeddings:
        out["head_w"], out["head_wt"] = head, params["embed"]
    else:
        out["head_w"], out["head_wt"] = params["lm_head"], head
    return out


def is_compute_params(params: dict[str, Any]) -> bool:
    return "head_wt" in params and isinstance(params["layers"], tuple)
