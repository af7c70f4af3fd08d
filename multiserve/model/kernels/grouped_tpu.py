"""A mixture-of-experts layer's grouped product on a TPU: JAX's megablox grouped matmul
(`jax.experimental.pallas.ops.tpu.megablox.gmm`, a Mosaic kernel, called as a library) over
rows already sorted by expert, each expert's matrix read where it lies in the stack.

`grouped_gmm(x, groups, w)`: y[m] = x[m] @ w[groups[m]] for rows sorted by `groups`, in
float32. The rows are padded to a multiple of the pinned row tile (ROW_TILE) with zero
rows of the last row's expert (the groups stay sorted and no other expert's matrix is
read for them; their outputs are dropped); the
kernel's tiles are pinned here (ROW_TILE rows, K_TILE and N_TILE columns, or the whole
dimension where it is smaller), never chosen by the row count.

Batch invariance, by construction: a row's output is the sum, over the K tiles in order,
of its own row of a [ROW_TILE, K_TILE] x [K_TILE, N_TILE] tile product with its own
expert's tile; the rows beside it in its tile (of its expert or another, masked at the
store) enter no row's arithmetic but their own. What changes with the batch is only which
tile a row lands in and how many tiles run.

Where it runs: compiled by Mosaic on a TPU; on any other platform the same kernel runs in
Pallas interpret mode (`lax.platform_dependent`: the lowering platform decides), which is
how the tests on the CPU check it. The calibration offers it on a TPU only
(probes.probe_grouped); an engine's compile for a TPU from this CPU (`doctor --compile`)
takes it from the target plan (target_export.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_TILE = 8  # rows of one tile (pinned: a sublane tile)
K_TILE = 128  # the contraction's tile (pinned; the whole K where it is smaller)
N_TILE = 128  # output columns of one tile (pinned; the whole N where it is smaller)


def gmm_usable(platform: str, sharded: bool) -> bool:
    """Whether the grouped matmul may serve a grouped product on `platform` (a device's,
    or jax.export's "tpu"): on a TPU, over experts held whole on each chip (a pallas_call is
    not partitioned by the compiler; split experts take "gather")."""
    return platform == "tpu" and not sharded


def grouped_gmm(x: jax.Array, groups: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by `groups` [M], int32 expert ids), w [E, K, N] -> [M, N]
    float32 (module docstring)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = x.shape
    experts, _, n = w.shape
    extra = -m % ROW_TILE
    if extra:
        x = jnp.pad(x, ((0, extra), (0, 0)))
        groups = jnp.concatenate([groups, jnp.broadcast_to(groups[-1:], (extra,))])
    sizes = jnp.bincount(groups, length=experts).astype(jnp.int32)
    tiling = (ROW_TILE, min(K_TILE, k), min(N_TILE, n))

    def run(interpret: bool) -> jax.Array:
        return gmm(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32,
                   tiling=tiling, interpret=interpret)

    out = jax.lax.platform_dependent(tpu=lambda: run(False), default=lambda: run(True))
    return out[:m]
