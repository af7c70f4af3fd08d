"""The invariance plan: how each row-invariant primitive computes a step of a given size.

A token's numerics must not depend on how many other tokens share its step. Which
formulation of a primitive gives every row the same bits at every size is a fact of the
backend (CPU model and ISA, GPU/TPU kind, XLA version), so it is measured on the machine
that runs the engine (`model/invariance/calibration.py`) and written down here, as data:

- `ProductPlan`, per contraction x[M, K] @ W[K, N]: for each row count M the engine runs,
  a `Formulation` (kernel "plain" = x @ W, "nt" = dot_general against W^T stored [N, K],
  or "native" = the CPU kernel of kernels/native.py against W's packed panels, in a
  bfloat16 engine by one instruction `path` (the same for every product and row count of
  the plan: `InvariancePlan.bf16_path`); computed at `rows` >= M rows, the extra rows zero
  padding);
- grouped products (a MoE layer's experts, moe.py) are ProductPlans too, named after their
  expert matrix (`we_gate`, `we_up`, `we_down`), per row count M = tokens x top-k: kernel
  "native" (the grouped CPU kernel), "gather" (each row against its expert's gathered
  matrix, an XLA batched product) or "gmm" (JAX's megablox grouped matmul, a TPU kernel:
  kernels/grouped_tpu.py), all at M rows (no padding);
- `RowSumPlan`, per row width: the row count each sum over the last axis is padded to
  (a row sum is an NT product with a block of ones: `primitives.row_sum`);
- `AttentionPlan`: which kernel ("xla": the pure-JAX formulation; "native": the CPU
  kernel of kernels/native.py; "pallas_gpu" / "pallas_tpu": JAX's Pallas paged-attention
  kernels, layers/attention_pallas.py; the last three invariant by construction and
  verified like the rest);
  for the XLA formulation, for each token count T, the query chunk C and the row count T
  is padded to, and whether a chunk of one sequence may gather its keys once
  (`shared_keys`).

Every entry of a plan was checked bitwise against one reference computation of its
primitive (the largest size, rows at several positions), so all its entries agree with
each other. Sizes between table entries take the next larger entry (the same program,
padded); sizes beyond the largest entry are split into chunks of that entry's rows
(products, row sums), so every size maps to a checked computation.

This module is plain data (no jax): config and the HTTP side may import it. The plan is
hashable and is a static argument of the jitted step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# "gather" and "gmm" serve grouped (mixture-of-experts) products only: each row against
# its own expert's matrix, gathered ([M, K] x [M, K, N] batched over rows), or by the TPU's
# grouped matmul over the rows sorted by expert (kernels/grouped_tpu.py)
KERNELS = ("plain", "nt", "native", "gather", "gmm")
# the native bfloat16 product's instruction paths, in the kernel's numbering
# (src/row_gemm_bf16.cc Path; kernels/native.py says what each is)
BF16_PATHS = ("avx512_bf16", "widen", "amx")
ATTENTION_KERNELS = ("xla", "native", "pallas_gpu", "pallas_tpu")


@dataclass(frozen=True)
class Formulation:
    """Compute M rows with `kernel` at `rows` rows (M <= rows; rows beyond M are zeros);
    `path`: the native kernel's bfloat16 instruction path (a BF16_PATHS name; "" for every
    other kernel and for float32)."""

    kernel: str
    rows: int
    path: str = ""

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown product kernel {self.kernel!r} (one of {KERNELS})")
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.path not in ("", *BF16_PATHS) or (self.path and self.kernel != "native"):
            raise ValueError(f"path {self.path!r} of kernel {self.kernel!r}: a native "
                             f"kernel's path is one of {BF16_PATHS}, other kernels have none")

    def to_json(self) -> list[Any]:
        return [self.kernel, self.rows, *([self.path] if self.path else [])]


def _entry(table: tuple[tuple[int, Any], ...], size: int) -> Any:
    """The value of the smallest table size >= size; beyond the table, the largest's (the
    caller splits such a size into pieces that entry holds)."""
    for limit, value in table:
        if size <= limit:
            return value
    return table[-1][1]


@dataclass(frozen=True)
class ProductPlan:
    """The formulation of one named contraction (a layer matrix or "head"; global shape
    K x N) at each row count."""

    name: str
    k: int
    n: int
    by_rows: tuple[tuple[int, Formulation], ...]  # (M, formulation), M ascending

    def formulation(self, m: int) -> Formulation:
        """The formulation of an M-row product (an M beyond the table is split into pieces
        of at most `rows` rows)."""
        return _entry(self.by_rows, m)


@dataclass(frozen=True)
class RowSumPlan:
    """Row sums of width `width`: a sum over R rows is computed at `padded` rows."""

    width: int
    by_rows: tuple[tuple[int, int], ...]  # (R, padded rows), R ascending

    def padded_rows(self, rows: int) -> int:
        """The row count a sum over `rows` rows is computed at (beyond the table: pieces
        of that many rows)."""
        return _entry(self.by_rows, rows)


@dataclass(frozen=True)
class AttentionPlan:
    """Paged attention. kernel "xla": a T-token step runs chunks of `chunk` query rows over
    T padded to `padded` rows; `shared_keys`: a chunk whose rows are one sequence gathers
    each key block once (else every row gathers its own). kernel "native": the native
    kernel computes every (token, head) alone at any T (the table is then (T, (1, T))), and
    so do the Pallas kernels "pallas_gpu" / "pallas_tpu" (layers/attention_pallas.py);
    `interpret`: a Pallas kernel runs in Pallas interpret mode (tests on the CPU)."""

    by_tokens: tuple[tuple[int, tuple[int, int]], ...]  # (T, (chunk, padded T))
    shared_keys: bool
    kernel: str = "xla"
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention kernel {self.kernel!r} "
                             f"(one of {ATTENTION_KERNELS})")

    def chunking(self, num_tokens: int) -> tuple[int, int]:
        """(chunk, padded token count) for a T-token step: the entry's program, padded
        (the same rows); beyond the table, the largest entry's chunk over T rounded up."""
        chunk, padded = _entry(self.by_tokens, num_tokens)
        return chunk, max(padded, -(-num_tokens // chunk) * chunk)


@dataclass(frozen=True)
class InvariancePlan:
    """Every primitive's plan. `verified`: each entry was checked bitwise on this backend
    (False: the calibration found no invariant formulation for some primitive, or the plan
    was not calibrated; `problems` says which)."""

    products: tuple[ProductPlan, ...]
    row_sums: tuple[RowSumPlan, ...]
    attention: AttentionPlan
    verified: bool
    problems: tuple[str, ...] = ()
    # Whether the backend's compiler copies a slice of a stacked weight (XLA:CPU does:
    # docs/performance.md §6), so the unrolled decoder reads per-layer copies of the layer
    # matrices and the scanned one switches over a bfloat16 stack's static slices. False
    # (an accelerator, which reads a slice in place): both decoders read slices of the
    # stacked canonical matrices, each matrix held once (llama.py, primitives.py)
    layer_copies: bool = True
    # the bfloat16 instruction path of every native product of the plan ("": none)
    bf16_path: str = ""

    def product(self, name: str) -> ProductPlan:
        for p in self.products:
            if p.name == name:
                return p
        raise KeyError(f"the invariance plan has no product {name!r} (calibrated: "
                       f"{[p.name for p in self.products]})")

    def row_sum(self, width: int) -> RowSumPlan:
        for r in self.row_sums:
            if r.width == width:
                return r
        raise KeyError(f"the invariance plan has no row sums of width {width} (calibrated: "
                       f"{[r.width for r in self.row_sums]})")

    def to_json(self) -> dict[str, Any]:
        return {
            "verified": self.verified,
            "problems": list(self.problems),
            "layer_copies": self.layer_copies,
            "products": [{"name": p.name, "k": p.k, "n": p.n,
                          "by_rows": [[m, *f.to_json()] for m, f in p.by_rows]}
                         for p in self.products],
            "bf16_path": self.bf16_path,
            "row_sums": [{"width": r.width, "by_rows": [list(e) for e in r.by_rows]}
                         for r in self.row_sums],
            "attention": {"kernel": self.attention.kernel,
                          "by_tokens": [[t, c, p] for t, (c, p) in self.attention.by_tokens],
                          "shared_keys": self.attention.shared_keys,
                          "interpret": self.attention.interpret},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InvariancePlan:
        return cls(
            products=tuple(ProductPlan(p["name"], p["k"], p["n"], tuple(
                (int(m), Formulation(str(kern), int(rows), *map(str, path)))
                for m, kern, rows, *path in p["by_rows"])) for p in d["products"]),
            bf16_path=str(d.get("bf16_path", "")),
            row_sums=tuple(RowSumPlan(r["width"], tuple((int(a), int(b)) for a, b in
                                                        r["by_rows"])) for r in d["row_sums"]),
            attention=AttentionPlan(tuple((int(t), (int(c), int(p))) for t, c, p in
                                          d["attention"]["by_tokens"]),
                                    bool(d["attention"]["shared_keys"]),
                                    str(d["attention"].get("kernel", "xla")),
                                    bool(d["attention"].get("interpret", False))),
            verified=bool(d["verified"]), problems=tuple(d.get("problems", ())),
            layer_copies=bool(d.get("layer_copies", True)))


@dataclass(frozen=True)
class Calibration:
    """A plan with how it was obtained: the key it is cached under (what decides kernels),
    the probe table (every candidate: checked against the reference or not, and its time),
    the probe's own seconds, and whether this start read it from the cache."""

    plan: InvariancePlan
    key: dict[str, Any]
    key_hash: str
    probe_seconds: float
    cached: bool
    table: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    def summary(self) -> dict[str, Any]:
        """The `determinism` block of get_server_info."""
        return {"verified": self.plan.verified, "problems": list(self.plan.problems),
                "plan": self.plan.to_json(), "probe_seconds": round(self.probe_seconds, 3),
                "cached": self.cached, "key": self.key, "key_hash": self.key_hash}
