"""LoRA adapters inside the dense decoder: each token's low-rank product with its own
adapter, added to a projection's output.

Device buffers (model/lora_layout.py `lora_buffer_shapes`; the runner holds them beside the params, and the
forward reads them as `params["lora"]`): for every target module m of `LORA_MODULES`
(model/lora_layout.py),
`<m>_a` [L, S, K, r] and `<m>_b` [L, S, r, N] (A and B of each slot, stored [in, out]),
with the native form also `<m>_bp`, B panel by panel (the one-token kernel's copy),
and `scale` [S] float32 (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). S =
max_loras_per_batch + 1 slots of r = max_lora_rank; slot 0 is "no adapter" (all zeros,
never written); an adapter of a smaller rank is zero-padded, a module it does not target
is zero. The buffers' shapes are fixed by the engine config, so loading, replacing or
unloading an adapter writes into them and never recompiles a step program.

Each token t carries its slot `slots[t]` (ForwardBatch.lora_slots). Invariants:
- A base-model token (slot 0) gets the projection's output itself, selected (`jnp.where`),
  not that output plus a zero product: its bits are those of the engine without LoRA.
- A token's delta reads only its own slot's matrices and its own activations, in one of
  two forms (`native_lora` picks one per engine; both hold this invariant):
  native (the CPU, where the plan's attention is the native kernel): the kernel of
  model/kernels/src/lora_delta.cc (`lora_apply_native`), per token its slot's A then B
  with float32 sums in an order fixed by the shapes (in order over k in float32, pairs
  of k in four fixed chains in bfloat16), reading the stacks in place and only the slots in use,
  the delta added to y in the kernel (a slot-0 token's y untouched), every projection
  of one x (q, k, v; gate, up) in one call on their fused product's output whole, each
  at its column offset (no copy of a projection's columns into a buffer of its own); at
  a one-token step where the plan's product is native, inside the product's own call
  instead (`LayerLora.product`, model/kernels/src/row_gemm_lora.cc: each panel's
  product, then the delta of its columns, with lora_delta.cc's per-element code from
  model/kernels/src/lora_math.h), the same bits as the product then the delta's call,
  so a token's bits are the same alone (one token) as in a batch;
  XLA (every other platform, a tensor-parallel engine, ranks above the kernel's): every
  op is elementwise over tokens, and the two contractions (over K, then over r) are explicit
  pairwise trees of elementwise adds (`_tree_sum`) in float32, in a fixed order, each
  product materialized before its sum (no multiply-add contraction that XLA might do in
  one program and not in another). So a token's delta is the same bits whatever the
  step's size and whatever adapters (or none) the other tokens use. Tokens run in static
  slices of at most `CHUNK` (memory), never through a `lax.map` loop: on XLA:CPU a
  mapped form gave company-dependent bits in the decoder (not reproduced standalone),
  which tests/engine/test_lora.py caught.
- The delta is added to the projection's output (with its residual, where the product
  adds one) in float32 and rounded once to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from multiserve.model.invariance.plan import InvariancePlan, ProductPlan

# Whether `LayerLora.product` fuses the delta into the product's call at one-token steps
# (read at trace time; scripts/ab_lora_step.py traces a program with it off to compare
# the two forms, bits and time, in one process)
FUSED_AT_ONE_TOKEN = True

# tokens per static slice of a step (bounds the gathered [slice, K, r] and [slice, r, N]
# operands); a slice's size never changes a token's bits (every op is elementwise over
# tokens)
CHUNK = 64


def _tree_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` as a fixed pairwise tree of elementwise adds (zero-padded to a
    power of two): the order depends only on the axis' length."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width > n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
               slots: jax.Array) -> jax.Array:
    """float32 [T, N]: token t's (x[t] @ A[slots[t]]) @ B[slots[t]] * scale[slots[t]],
    for one layer's a [S, K, r], b [S, r, N] (see the module docstring)."""
    return jnp.concatenate([_delta(x[i:i + CHUNK], a, b, scale, slots[i:i + CHUNK])
                            for i in range(0, x.shape[0], CHUNK)])


def _delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
           slots: jax.Array) -> jax.Array:
    """`lora_delta` of one slice of tokens. Each product is materialized before its sum
    (`_rounded`): no multiply is fused with an add (an FMA rounds once where the product
    and the sum round twice, and whether XLA contracts one depends on the program around
    it)."""
    xa = _tree_sum(_rounded(x.astype(jnp.float32)[:, :, None]
                            * a[slots].astype(jnp.float32)), 1)  # [T, r]
    d = _tree_sum(_rounded(xa[:, :, None] * b[slots].astype(jnp.float32)), 1)  # [T, N]
    return _rounded(d * scale[slots][:, None])


def _rounded(x: jax.Array) -> jax.Array:
    """`x` materialized as computed: XLA fuses nothing across it (no multiply-add
    contraction with what follows)."""
    return jax.lax.optimization_barrier(x)


def native_lora(plan: InvariancePlan, lora: dict[str, jax.Array]) -> bool:
    """Whether the forward's LoRA delta is the native CPU kernel: where the plan's attention
    is the native CPU kernel (the CPU, the kernels built, attention not split over a
    tensor-parallel group), the buffers are float32 or bfloat16 and their rank fits the
    kernel. Fixed for an engine (its plan and buffers), so every step uses one form."""
    from multiserve.model.kernels import native

    a = lora["wq_a"]
    return (plan.attention.kernel == "native" and a.shape[-1] <= native.LORA_MAX_RANK
            and str(a.dtype) in native.DTYPES
            and native.unavailable_reason(str(a.dtype)) is None)


@dataclass(frozen=True)
class LayerLora:
    """One layer's LoRA adapters in the forward (`lora`'s stacks read at `layer`, static or
    traced; each token's slot in `slots`; `native`: the kernel form, `native_lora`).
    Called as an `Adapt`: y with each adapter token's delta of each projection added to
    that projection's columns (every projection of the same x at once, in their fused
    product's output: one native call). `product`: at a one-token step, the native product
    with the delta in its epilogue (one call in place of the product's and this one's)."""

    lora: dict[str, jax.Array]
    layer: int | jax.Array
    slots: jax.Array
    native: bool = False

    def __call__(self, x: jax.Array, names: tuple[str, ...], y: jax.Array,
                 offsets: tuple[int, ...]) -> jax.Array:
        lora, layer, slots = self.lora, self.layer, self.slots
        a = tuple(lora[f"{name}_a"] for name in names)
        b = tuple(lora[f"{name}_b"] for name in names)
        if self.native and all(v.dtype == x.dtype for v in (y, *a)):
            from multiserve.model.kernels.native import lora_apply_native

            return lora_apply_native(x, y, a, b, offsets, lora["scale"], slots, layer)
        on = (slots > 0)[:, None]
        for am, bm, start in zip(a, b, offsets, strict=True):
            n = bm.shape[-1]
            part = y[:, start:start + n]
            part = jnp.where(on, (part.astype(jnp.float32) + _rounded(
                lora_delta(x, am[layer], bm[layer], lora["scale"], slots))).astype(y.dtype),
                part)
            y = part if n == y.shape[1] else jax.lax.dynamic_update_slice(y, part, (0, start))
        return y

    def product(self, x: jax.Array, names: tuple[str, ...], panels: jax.Array | None,
                plan: ProductPlan, offsets: tuple[int, ...],
                residual: jax.Array | None = None) -> jax.Array | None:
        """`dense(x, .., plan, w_p=panels, layer=, residual=)` then `self(x, names, that,
        offsets)` as ONE native call with the same bits (native.row_gemm_lora), where it
        applies: a one-token step (T static), the plan's product native, the kernel form
        of LoRA, and x, the panels, the adapters and the residual of one dtype. None
        elsewhere: the caller runs the two calls. Computed at one row where the plan pads
        the row to more (a timing choice of the calibration): the native product's row is
        the same bits at every row count (src/row_gemm.cc)."""
        form = plan.formulation(x.shape[0])
        a = tuple(self.lora[f"{name}_a"] for name in names)
        if (not FUSED_AT_ONE_TOKEN or not self.native or x.shape[0] != 1 or panels is None
                or any(f"{name}_bp" not in self.lora for name in names)
                or form.kernel != "native" or any(v.dtype != x.dtype for v in (panels, *a))
                or (residual is not None and residual.dtype != x.dtype)):
            return None
        from multiserve.model.kernels.native import row_gemm_lora

        b = tuple(self.lora[f"{name}_b"] for name in names)
        b_panels = tuple(self.lora[f"{name}_bp"] for name in names)
        return row_gemm_lora(x, panels, plan.n, self.layer, a, b, offsets,
                             self.lora["scale"], self.slots, residual=residual,
                             path=form.path or None, b_panels=b_panels)


Adapt = LayerLora


def layer_adapter(lora: dict[str, jax.Array], layer: int | jax.Array,
                  slots: jax.Array, native: bool = False) -> LayerLora:
    """The `LayerLora` of one layer (its slice of each stacked buffer, `layer` static or
    traced); `native`: the kernel form (`native_lora`), else the XLA form."""
    return LayerLora(lora, layer, slots, native)
