"""Row-invariant primitives: dense and grouped (expert) products, the weight layouts they
need, and row sums.

A token's numerics must not depend on how many other tokens share its step (the engine's
determinism rests on it), so every product x[M, K] @ W[K, N] and every sum over a row in
the model must give each row bitwise the same value for every row count M the engine runs.

Which formulation does that is a backend fact (which kernel XLA picks for which shape, how
it splits the contraction), and it differs between machines: the M = 1 plain product (a
GEMV) agrees with the NT product at M >= 2 on one CPU and not on another
(docs/performance.md §2). So nothing here hard-codes it: `dense` and `row_sum` compute
what the engine's `InvariancePlan` says (model/invariance/plan.py), and the plan is
measured on the machine that runs the engine (model/invariance/calibration.py), checked
bitwise against one reference.

Formulations (`Formulation.kernel`):
- "plain": `x @ W` against W stored [K, N];
- "nt": `dot_general(x, Wt)` contracting x's dim 1 with Wt's dim 1, Wt = W^T stored
  [N, K] (a transposed copy, see `with_transposed`);
- "native": the CPU kernel of kernels/native.py against W packed in 64-column panels
  (`<name>_p`, see `with_transposed`), invariant by construction at every row count (a
  bfloat16 product by the formulation's instruction `path`);
each at `Formulation.rows` rows: M rows are zero-padded up to that (the rows beyond M are
dropped), and an M beyond the plan's largest entry is split into pieces of that size.

Row sums (RMSNorm): an NT product with a block of ROW_SUM_COLUMNS ones, padded to the
plan's row count for the sum's width (XLA's own reductions change their summation order
with the operand's size). Max/min reductions are exact and need nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.plan import ProductPlan, RowSumPlan
from multiserve.model.kernels.grouped_tpu import grouped_gmm
from multiserve.model.kernels.native import (
    PANEL,
    grouped_row_gemm,
    pack_panels,
    row_gemm,
    unpack_panels,
)

# the matrices of one layer that get a transposed copy ("<name>_t", [L, out, in])
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Layer matrices that read the same input, computed as ONE native product of their panels
# side by side where the plan runs them alike (llama.fused_groups): each output element is
# still its own sum over k in order, so the bits are those of the separate products; one
# kernel call instead of three (two) per layer streams the weights faster
# (docs/performance.md §3).
FUSED_GROUPS = {"wqkv": ("wq", "wk", "wv"), "w_gateup": ("w_gate", "w_up")}
NT = (((1,), (1,)), ((), ()))  # dot_general dims: x[M, K] . Wt[N, K] -> [M, N]
ROW_SUM_COLUMNS = 8  # columns of ones in `row_sum` (a 1-column product is a GEMV)
# Every XLA product multiplies its operands at their own precision: float32 operands in
# float32 (an accelerator's default may round them to TF32 or bfloat16 first, which the
# calibration's float32 references and the float32 engine's exact logprobs rule out);
# bfloat16 operands are exact in any mode. XLA:CPU computes float32 products in float32
# either way.
EXACT = jax.lax.Precision.HIGHEST


def product(x: jax.Array, w: jax.Array | None, w_t: jax.Array | None, kernel: str, rows: int,
            preferred: Any = None, w_p: jax.Array | None = None, n: int = 0,
            layer: int | jax.Array | None = None,
            residual: jax.Array | None = None, path: str = "") -> jax.Array:
    """x [M, K] @ W with one formulation: `kernel` at `rows` >= M rows (zero padding). The
    native kernel reads `w_p` (W packed, `pack_panels`; with `layer`, a stack of layers
    [L, P, K, 64], bfloat16 [L, P, ceil(K / 2), 128], read in place) and needs N (`n`).
    Every kernel computes the float32 result the calibration checked (its probes ask for
    float32), rounded once to `preferred` where given (the output head's logits: float32),
    else to x's dtype (a bfloat16 model's activations: round to nearest even).
    `residual` [M, N] (x's dtype): the result is `residual + x @ W` in that dtype; the
    native bfloat16 kernel adds it in its epilogue with the same bits (an elementwise add
    after each row's product: the rows stay invariant). `path`: the native bfloat16
    product's instruction path (a BF16_PATHS name; "": the process's default)."""
    m = x.shape[0]
    out_dtype = jnp.dtype(preferred or x.dtype)
    fuse = (residual is not None and kernel == "native" and w_p is not None
            and w_p.dtype == jnp.bfloat16 and out_dtype == jnp.bfloat16
            and residual.dtype == jnp.bfloat16)
    if rows > m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
        if fuse:
            residual = jnp.pad(residual, ((0, rows - m), (0, 0)))
    if kernel == "native":
        assert w_p is not None and n > 0, "the native product needs W's panels and N"
        out = row_gemm(x, w_p, n, layer, out_dtype=out_dtype,
                       residual=residual if fuse else None, path=path or None)
    elif kernel == "plain":
        assert w is not None, "the plain product needs W [K, N]"
        out = jnp.dot(x, w, precision=EXACT, preferred_element_type=jnp.float32).astype(out_dtype)
    else:
        assert w_t is not None, "the NT product needs W^T [N, K]"
        out = jax.lax.dot_general(x, w_t, NT, precision=EXACT,
                                  preferred_element_type=jnp.float32).astype(out_dtype)
    out = out[:m] if rows > m else out
    return residual + out if residual is not None and not fuse else out


def _in_pieces(f: Callable[..., jax.Array], rows: int, x: jax.Array,
               *more: jax.Array | None) -> jax.Array:
    """f(x, *more) over the rows of x and of each of `more` (None passes as None) in pieces
    of at most `rows` rows (one piece when x fits: a size beyond the plan's table is
    computed as several of its largest entry)."""
    if x.shape[0] <= rows:
        return f(x, *more)
    return jnp.concatenate([f(x[i:i + rows], *(None if a is None else a[i:i + rows]
                                               for a in more))
                            for i in range(0, x.shape[0], rows)], axis=0)


def dense(x: jax.Array, w: jax.Array | None, w_t: jax.Array | None, plan: ProductPlan,
          preferred: Any = None, w_p: jax.Array | None = None,
          layer: int | jax.Array | None = None,
          residual: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ W -> [M, N], each row bitwise independent of M (the plan's formulation for
    M rows). `w` is W [K, N], `w_t` W^T [N, K], `w_p` W's panels (a stack over layers
    with `layer`); only the layout the plan's kernel at this M uses must be given. M is
    static (a shape): the choice is made at trace time. With `residual` [M, N]: `residual +
    x @ W` (`product`)."""
    form = plan.formulation(x.shape[0])
    return _in_pieces(lambda part, res: product(part, w, w_t, form.kernel, form.rows,
                                                preferred, w_p, plan.n, layer, res,
                                                form.path),
                      form.rows, x, residual)


def grouped(x: jax.Array, groups: jax.Array, w: jax.Array | None, w_p: jax.Array | None,
            plan: ProductPlan, first_group: int | jax.Array) -> jax.Array:
    """y[m] = x[m] @ W[groups[m]] [M, N] by the plan's formulation for M rows (computed at
    its `rows`, zero rows of expert 0 appended; the calibration chooses rows = M unless a
    formulation is only invariant at a larger size): "native" reads
    the panels of every layer's experts `w_p` [L*E, P, K, 64] at group first_group +
    groups[m] (this layer's experts start at first_group); "gather" gathers this layer's
    expert matrices `w` [E, K, N] per row (float32 accumulation); "gmm" runs the TPU's
    grouped matmul over the rows (sorted by expert, as the MoE layer gives them) and `w`
    (kernels/grouped_tpu.py)."""
    m = x.shape[0]
    form = plan.formulation(m)
    if form.rows > m:  # the checked computation is at form.rows rows: pad (expert 0) to it
        x = jnp.pad(x, ((0, form.rows - m), (0, 0)))
        groups = jnp.pad(groups, (0, form.rows - m))
    if form.kernel == "native":
        assert w_p is not None, "the native grouped product needs the experts' panels"
        out = grouped_row_gemm(x, w_p, groups + first_group, plan.n, out_dtype=jnp.float32,
                               path=form.path or None)
    elif form.kernel == "gmm":
        assert w is not None, "the grouped matmul needs W [E, K, N]"
        out = grouped_gmm(x, groups, w)
    else:
        assert form.kernel == "gather" and w is not None, (form.kernel, "needs W [E, K, N]")
        out = jnp.einsum("mk,mkn->mn", x, w[groups], precision=EXACT,
                         preferred_element_type=jnp.float32)
    return out[:m].astype(x.dtype)


def row_sum_rows(flat: jax.Array, rows: int) -> jax.Array:
    """Sums of the rows of flat [M, K] (M <= rows) computed at `rows` rows: [M]."""
    m = flat.shape[0]
    if rows > m:
        flat = jnp.pad(flat, ((0, rows - m), (0, 0)))
    ones = jnp.ones((ROW_SUM_COLUMNS, flat.shape[-1]), flat.dtype)
    return jax.lax.dot_general(flat, ones, NT, precision=EXACT)[:m, 0]


def row_sum(x: jax.Array, plan: RowSumPlan) -> jax.Array:
    """Sum over the last axis of x [..., K] (f32), each row bitwise independent of how many
    rows x has (the plan's padding for this width). Leading axes are flattened into rows."""
    assert x.shape[-1] == plan.width, (x.shape, plan.width)
    flat = x.reshape(-1, x.shape[-1])
    rows = plan.padded_rows(flat.shape[0])
    return _in_pieces(lambda part: row_sum_rows(part, rows), rows, flat).reshape(x.shape[:-1])


def _transpose_last(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, -1, -2)


# Helpers over pytrees of stacked arrays (shared with moe_decoder's compute params). Each
# runs one small program per leaf, compiled once per leaf shape: one program over a whole
# tree compiles far longer for the same moves (docs/performance.md §27), and engines that
# build at once (a fleet) each compiled it.
_transposed = jax.jit(_transpose_last)
_packed = jax.jit(pack_panels)


def transpose_tree(tree: Any) -> Any:
    """Every leaf [.., K, N] as [.., N, K] (a copy)."""
    return jax.tree.map(_transposed, tree)


def pack_tree(tree: Any) -> Any:
    """Every leaf as the native kernels' panels (`pack_panels`)."""
    return jax.tree.map(_packed, tree)


_layer_of = jax.jit(lambda a, i: a[i])  # one stacked array's layer i (i traced)


def split_layers(layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """Stacked [L, ...] layer params -> one dict of separate arrays per layer (copies, each
    keeping its source's sharding minus the layer axis). One small program per array
    shape, run once per layer and array: one program over the whole tree (L x arrays
    outputs) compiles ~10x longer for the same copies (docs/performance.md §27)."""
    num_layers = next(iter(layers.values())).shape[0]
    return tuple({name: _layer_of(a, np.int32(i)) for name, a in layers.items()}
                 for i in range(num_layers))


LAYOUT_SUFFIX = {"plain": "", "nt": "_t", "native": "_p"}  # kernel -> weight layout name


def with_transposed(params: dict[str, Any], cfg: ModelConfig, stacked_t: bool = False,
                    kernels: frozenset[str] = frozenset(LAYOUT_SUFFIX),
                    matrices: tuple[str, ...] = LAYER_MATRICES,
                    fused: tuple[str, ...] = (),
                    head_kernels: frozenset[str] | None = None,
                    stacked_plain: bool = True, layer_copies: bool = True,
                    unrolled: bool = True) -> dict[str, Any]:
    """The compute params the forward runs on, derived from the canonical pytree (matrices
    [in, out] stacked over layers, see param_layout), holding each layer matrix in the
    layouts of the product `kernels` the invariance plan uses (`llama.plan_kernels`; by
    default every layout, for code that runs several plans):
    - `layers`: a TUPLE with one dict per layer, each matrix in the XLA kernels' layouts
      (`<name>` W [in, out] for "plain", `<name>_t` W^T [out, in] for "nt") and the
      layer's norms/biases, each a separate device array. The unrolled decoder loops over
      this tuple: a layer reads its weights in place, where a scan over stacked arrays
      copies every layer's matrices out of the stack at every step (a large share of a
      one-token step on XLA:CPU: docs/performance.md §6).
    - `stacked_layers`: the canonical stacked layer arrays (shared, no copy), which the
      scanned decoder of large steps reads (without `stacked_plain` and with "native", the
      layer matrices are not among them: no scanned size reads W [in, out] stacked, and
      their panels hold them exactly, `canonical_layer_matrices`); with `stacked_t` (the
      plan uses the NT product at a scanned size) also the stacked transposes `<name>_t`
      [L, out, in]; with
      "native" the stacked panels `<name>_p` [L, N/64, K, 64] (bfloat16 weights: k-pair
      panels [L, N/64, ceil(K/2), 128], pack_panels), which the native kernel
      indexes by layer itself (no per-layer copy, none in a scan either);
    - `embed`, `final_norm`: the canonical arrays (shared, no copy);
    - the output head as `head_w` [D, V] and `head_wt` [V, D] (tied embeddings reuse
      `embed` as `head_wt`: no copy), and with "native" its panels `head_wp`; the one of
      the two that is a transposed copy is None where no kernel of `kernels` reads its
      layout ("plain" reads `head_w`, "nt" `head_wt`): a head the plan runs natively
      holds no [D, V] copy (113 MB for SmolLM2-135M in float32).
    Copies keep their source's sharding (minus the layer axis; transposed for `_t`).
    `matrices`: the layer matrices of `params["layers"]` (a MoE family passes the attention
    projections only; its MLP groups have their own layouts, moe_decoder.py).
    `fused`: FUSED_GROUPS whose members the plan runs natively alike at every step size:
    their panels are stacked side by side as `<group>_p` [L, P1 + P2 (+ P3), ...] (the
    panel axis, -3, in both panel layouts) instead of each member's own `<name>_p` (never both: no weight is held twice).
    `head_kernels`: the kernels of the head's product where they are not `kernels` (None:
    the same), so a head run in an XLA layout at some size keeps no per-layer copy of the
    layer matrices, which `kernels` alone decides.
    `stacked_plain`: the scanned decoder runs some layer matrix on the plain product at
    some step size (`llama.scan_needs_plain`), so it reads the canonical stacks.
    `layer_copies` False (the plan's `layer_copies`: an accelerator): `layers` holds
    nothing of its own (a tuple of empty dicts); the unrolled decoder reads static slices
    of the stacks (the canonical ones, norms and biases included, and with "nt" the
    stacked transposes, which `stacked_t` must then keep).
    `unrolled` False: no step runs the unrolled decoder (a model that scans at every
    size, `llama.scans`), so `layers` holds no matrix (the per-layer copies would never
    be read)."""
    layers = params["layers"]
    keep_t = "nt" in kernels or stacked_t  # else no layer matrix is transposed at all
    to_transpose: dict[str, Any] = ({name: layers[name] for name in matrices}
                                    if keep_t else {})
    to_transpose["head"] = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    done = transpose_tree(to_transpose)
    head = done.pop("head")
    out = {k: v for k, v in params.items() if k != "layers"}
    per_layer = {k: v for k, v in layers.items()
                 if layer_copies and (k not in matrices or ("plain" in kernels and unrolled))}
    stacked = dict(layers)
    if keep_t:
        transposed = {f"{name}_t": a for name, a in done.items()}
        if layer_copies and unrolled:
            per_layer.update(transposed)
        if stacked_t:
            stacked.update(transposed)
    if "native" in kernels:  # stacked only: the kernel reads its layer in place
        assert all(m in matrices for g in fused for m in FUSED_GROUPS[g]), (fused, matrices)
        packed = pack_tree({f"{name}_p": layers[name] for name in matrices})
        for group in fused:
            parts = [packed.pop(f"{m}_p") for m in FUSED_GROUPS[group]]
            packed[f"{group}_p"] = jnp.concatenate(parts, axis=-3)
        stacked.update(packed)
        if not stacked_plain:  # each matrix is held once, as its panels
            for name in matrices:
                del stacked[name]
    out["stacked_layers"] = stacked
    out["layers"] = (split_layers(per_layer) if per_layer
                     else tuple({} for _ in range(cfg.num_layers)))
    if not stacked_t:
        for a in done.values():
            _free(a)  # the stacked transposes were only the source of the per-layer copies
    if cfg.tie_word_embeddings:
        out["head_w"], out["head_wt"] = head, params["embed"]
    else:
        out["head_w"], out["head_wt"] = params["lm_head"], head
    head_kernels = kernels if head_kernels is None else head_kernels
    if "native" in head_kernels:
        out["head_wp"] = pack_tree(out["head_w"])
    # a transposed head copy in a layout no kernel of the plan reads is dropped (None): the
    # canonical head (embed, or lm_head) always stays
    for key, kernel in (("head_w", "plain"), ("head_wt", "nt")):
        if kernel not in head_kernels and out[key] is head:
            _free(head)
            out[key] = None
    return out


def _free(a: jax.Array) -> None:
    """Free a device array made here and not kept (a traced one, under an abstract
    conversion: model/abstract_params.py, has no buffer)."""
    if not isinstance(a, jax.core.Tracer):
        a.delete()


def canonical_layer_matrices(stacked: dict[str, jax.Array],
                             shapes: dict[str, tuple[int, int]],
                             names: tuple[str, ...] | None = None) -> dict[str, jax.Array]:
    """The stacked layer matrices W [L, in, out] that `with_transposed` holds only as
    native panels (absent from `stacked`, the compute params' `stacked_layers`), rebuilt
    from their panels (`<name>_p`, or their columns of a fused group's `<group>_p`) bit for
    bit (`unpack_panels`: a pure layout move). `shapes`: {name: (in, out)} of every layer
    matrix; `names`: the ones to rebuild (None: every one absent from `stacked`)."""
    missing = {name: shapes[name] for name in (names if names is not None else shapes)
               if name not in stacked}
    sources: dict[str, tuple[str, int]] = {}  # name -> (its panel stack, first panel)
    for group, members in FUSED_GROUPS.items():
        first = 0
        for member in members:
            if member in missing and f"{group}_p" in stacked:
                sources[member] = (f"{group}_p", first)
            first += -(-shapes[member][1] // PANEL) if member in shapes else 0
    for name in missing:
        sources.setdefault(name, (f"{name}_p", 0))
        assert sources[name][0] in stacked, f"{name}: neither W nor its panels are held"
    return _unpack_stacks({name: stacked[src] for name, (src, _) in sources.items()},
                          tuple((name, sources[name][1], *missing[name]) for name in missing))


@partial(jax.jit, static_argnums=1)
def _unpack_stacks(panels: dict[str, jax.Array], where: tuple[tuple[str, int, int, int], ...]
                   ) -> dict[str, jax.Array]:
    """{name: unpack_panels of its panels [first, first + ceil(n / 64)) on the panel axis}
    for each (name, first, k, n) of `where`."""
    return {name: unpack_panels(jax.lax.slice_in_dim(
        panels[name], first, first + -(-n // PANEL), axis=panels[name].ndim - 3), k, n)
        for name, first, k, n in where}


def is_compute_params(params: dict[str, Any]) -> bool:
    return "head_wt" in params and isinstance(params["layers"], tuple)
