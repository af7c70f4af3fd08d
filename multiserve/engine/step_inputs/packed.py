"""A step program's small host inputs packed into ONE int32 array: one host-to-device
transfer per program, not one per array.

Why: each `jax.device_put` has a fixed host cost per array (a T program has 8 step arrays,
a SamplingBatch ~20 fields), and on a CPU backend the host's time is taken from the cores
the device step runs on: at one decode row the launch was a noticeable share of the step
(docs/performance.md §1).

Invariants:
- `pack(tree)` and `layout_of(tree)` walk the leaves in the same (jax.tree) order, so a
  program lowered with `layout_of(t)` reads `pack(u)` right for every `u` with t's
  structure, shapes and dtypes (a bucket's inputs always have them).
- Leaves are 32-bit (int32, uint32, float32) or bool; 32-bit values travel bit for bit
  (bitcast), bools as 0 / 1. Anything else is refused, never converted.
- None leaves are no leaves (jax.tree): a field left out of the pack (e.g. a device array
  passed on its own) is None in the packed tree and filled in by the program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_BITCAST = ("float32", "uint32")  # carried as int32 bits
# leaf dtype -> carried as its int32 bits (a view) or converted (bool -> 0 / 1); a dict
# lookup, since numpy's dtype.name is slow next to it and every leaf of every step needs one
# (docs/performance.md §1)
_BITS = {np.dtype(np.int32): True, np.dtype(np.float32): True, np.dtype(np.uint32): True,
         np.dtype(np.bool_): False}


@dataclass(frozen=True)
class Layout:
    """The static description of a packed tree: its structure and each leaf's shape and
    dtype name, in pack order (hashable: a jit static argument)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.leaves)


def _as_int32(leaf: Any) -> np.ndarray:
    a = np.asarray(leaf)
    bits = _BITS.get(a.dtype)
    if bits is None:
        raise TypeError(f"step_inputs.packed: a {a.dtype} leaf cannot be packed (32-bit or bool "
                        "only)")
    if not bits:
        return a.astype(np.int32).reshape(-1)
    return np.ascontiguousarray(a).view(np.int32).reshape(-1)


def layout_of(tree: Any) -> Layout:
    leaves, treedef = jax.tree.flatten(tree)
    return Layout(treedef, tuple((tuple(np.shape(x)), np.asarray(x).dtype.name)
                                 for x in leaves))


def pack(tree: Any) -> np.ndarray:
    """Every leaf of `tree` (host values) as one flat int32 array, in layout order."""
    parts = [_as_int32(x) for x in jax.tree.leaves(tree)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack(flat: jax.Array, layout: Layout) -> Any:
    """The tree `pack` flattened (traced: static slices, reshapes and bitcasts)."""
    assert flat.shape == (layout.size,), (flat.shape, layout.size)
    out, start = [], 0
    for shape, dtype in layout.leaves:
        n = math.prod(shape)
        seg = flat[start:start + n].reshape(shape)
        start += n
        if dtype == "bool":
            seg = seg != 0
        elif dtype in _BITCAST:
            seg = lax.bitcast_convert_type(seg, jnp.dtype(dtype))
        out.append(seg)
    return jax.tree.unflatten(layout.treedef, out)
