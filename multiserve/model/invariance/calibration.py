"""Calibration: the engine measures its own invariance plan on the backend it runs on.

For every primitive a step uses (each layer matrix and the output head at every row count
the engine runs, the RMSNorm row sums, paged attention at every token count), candidate
formulations are run on random data, with every probe row placed at several positions,
and their rows compared BITWISE:

- products: kernel "plain" (x @ W) and "nt" (x . W^T), each at every engine size and at
  2, 4, 8, 16, 32, 64 rows (a smaller M can be zero-padded up to any of them); and where
  it builds (CPU, float32, one device) the native kernel of native_kernels.py at every
  engine size (invariant by construction: one class, no padding);
- row sums: the ones-product padded to every count used and to 2, 4, 8, 16, 32, 64;
- attention: first the native CPU kernel (native_kernels.py; where it builds, the pool
  is float32 and the heads are not split over devices) at every token count T: it is
  row-invariant by construction, so if every size's rows equal its own reference it is
  chosen (it reads K/V in place: 3-6x faster than the XLA formulation, measured in
  native_kernels.py). Otherwise the XLA formulation: query chunk C in QUERY_CHUNKS at
  every token count T (T padded up to a multiple of C, or to C), with and without the
  one-sequence key sharing.

Selection, per primitive: each candidate at the LARGEST size is a possible reference
(an anchor) if its own rows agree wherever they are placed. A candidate belongs to an
anchor's class if every probe row it computed equals the anchor's row bitwise. For each
anchor, every size the engine runs takes the fastest member able to hold it (rows >= the
size); the anchor whose plan costs least (the sum, over sizes, of each member's time over
the fastest candidate's) wins. The anchor is a member of its own class, so padding every
step to the largest size is always there as the last resort; if no anchor's rows are
position-invariant the primitive has no invariant plan and the plan says so
(`verified=False`, `problems`), loudly.

The result is cached as JSON, keyed by what decides kernels (platform, device kind, CPU
model and flags, whether the native kernel builds, jax/jaxlib, XLA_FLAGS, dtype, every
shape and size): a second start with the same key probes nothing. Each product, grouped
and row-sum probe is also stored on its own (invariance/probes/): a workload that differs
only elsewhere (another page size, other buckets of the same shapes) re-probes only what
differs, in any process. `$MULTISERVE_CACHE_DIR/invariance/` (default
~/.cache/multiserve/invariance); one process probes a key at a time (a lock file).

`distort` (tests and `multiserve doctor --alien`): a predicate over (primitive, candidate)
naming candidates whose rows should be treated as computed differently (their hashes are
changed), so a test can make the probe see an alien backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.cache_files import cache_root, exclusive
from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.attention import QUERY_CHUNKS, paged_attention
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.invariance.plan import (
    AttentionPlan,
    Calibration,
    Formulation,
    InvariancePlan,
    ProductPlan,
    RowSumPlan,
)
from multiserve.model.invariance.primitives import product, row_sum_rows

log = logging.getLogger("multiserve.calibration")

PROBE_VERSION = 5  # bump when a probe or the selection changes: old cache entries are ignored
PAD_SIZES = (2, 4, 8, 16, 32, 64)  # extra row counts a small step may be padded to
TIMING_RUNS = 3
# (primitive, candidate description) -> treat this candidate's rows as different
Distort = Callable[[str, dict[str, Any]], bool]


# ---- what the engine runs ------------------------------------------------------------------
@dataclass(frozen=True)
class ProductUse:
    name: str  # layer matrix name or "head"
    k: int  # global contraction shape (what the model traces)
    n: int
    local_k: int  # the shape one device computes (tensor parallelism splits one side)
    local_n: int
    sizes: tuple[int, ...]  # row counts the engine runs
    sharded: bool = False  # the engine is tensor-parallel (GSPMD-partitioned operands)


@dataclass(frozen=True)
class AttentionUse:
    kv_heads: int  # per device
    group: int
    head_dim: int
    page_size: int
    block_size: int
    sizes: tuple[int, ...]  # token counts the engine runs
    sharded: bool = False  # heads split over a tensor-parallel group (GSPMD-partitioned)


@dataclass(frozen=True)
class GroupedUse:
    """A grouped (mixture-of-experts) product: rows x[m] @ W[expert of m], `experts`
    matrices of (local) shape local_k x local_n, at every routed-pair count in `sizes`
    (tokens x top-k)."""

    name: str
    k: int
    n: int
    local_k: int
    local_n: int
    experts: int
    sizes: tuple[int, ...]
    sharded: bool = False


@dataclass(frozen=True)
class Workload:
    """Every primitive size an engine will run: the input of the calibration."""

    dtype: str
    products: tuple[ProductUse, ...]
    row_sums: tuple[tuple[int, tuple[int, ...]], ...]  # (width, row counts)
    attention: AttentionUse
    grouped: tuple[GroupedUse, ...] = ()  # a MoE family's expert products


def workload_for(cfg: Any, token_sizes: Sequence[int], row_sizes: Sequence[int],
                 max_rows: int, page_size: int, block_size: int, dtype: Any,
                 tp: int = 1, moe_sharding: str = "tensor",
                 engine_defaults: bool = True) -> Workload:
    """The workload of an engine: model config `cfg` (ModelConfig), its step buckets and
    its tensor-parallel degree (the family's rules, model/families, decide which side of
    each matrix a device holds, and which products it runs: `product_shapes`, and for a
    MoE family the grouped expert products `grouped_shapes`).

    The sizes always include the default EngineConfig's buckets: engines of one model with
    other buckets (a fleet's per-engine overrides, tests, reference loops) then calibrate
    the same workload and share one plan, hence one reference and the same bits.
    `engine_defaults=False` leaves them out (a probe of exactly the given sizes: tests of
    the calibration itself)."""
    from multiserve.config import EngineConfig
    from multiserve.model.families import family_for
    from multiserve.model.families.base import tp_splits

    default = EngineConfig()
    extra_tokens = default.precompile_token_paddings if engine_defaults else ()
    extra_rows = default.precompile_bs_paddings if engine_defaults else ()
    tokens = tuple(sorted(set(token_sizes) | set(extra_tokens)))
    rows = tuple(sorted(set(row_sizes) | set(extra_rows) | {max_rows}))
    attn = tp_splits(cfg, tp)["attention"]
    family = family_for(cfg)

    def local(k: int, n: int, split: str) -> tuple[int, int]:
        return (k // tp if split == "in" else k), (n // tp if split == "out" else n)

    products = [ProductUse(p.name, p.k, p.n, *local(p.k, p.n, p.split),
                           rows if p.rows == "rows" else tokens, sharded=tp > 1)
                for p in family.product_shapes(cfg, tp, moe_sharding)]
    pairs = tuple(t * cfg.num_experts_per_tok for t in tokens)
    grouped = tuple(GroupedUse(g.name, g.k, g.n, *local(g.k, g.n, g.split), cfg.num_experts,
                               pairs, sharded=tp > 1)
                    for g in family.grouped_shapes(cfg, tp, moe_sharding))
    heads = cfg.num_heads // tp if attn else cfg.num_heads
    kv_heads = cfg.num_kv_heads // tp if attn else cfg.num_kv_heads
    row_sums = [(cfg.hidden_size, tuple(sorted(set(tokens) | set(rows))))]
    if cfg.qk_norm:
        row_sums.append((cfg.head_dim, tuple(sorted({t * h for t in tokens
                                                      for h in (heads, kv_heads)}))))
    return Workload(dtype=str(np.dtype(dtype)), products=tuple(products),
                    row_sums=tuple(row_sums),
                    attention=AttentionUse(kv_heads, cfg.num_heads // cfg.num_kv_heads,
                                           cfg.head_dim, page_size, block_size, tokens,
                                           sharded=attn), grouped=grouped)


# ---- candidates and their rows -------------------------------------------------------------
@dataclass
class Candidate:
    """One formulation at one size: which probe rows it computed, their hashes per
    placement, and its time."""

    desc: dict[str, Any]  # what it is (kernel/chunk, rows, ...), as shown in the table
    rows: int  # how many rows one run holds (what it can serve: any size <= rows)
    runs: list[dict[int, int]]  # per placement: probe row index -> hash of its output
    seconds: float

    def agrees(self, ref: dict[int, int]) -> bool:
        """Every probe row this candidate computed that `ref` holds has ref's bits."""
        return all(ref.get(i, h) == h for run in self.runs for i, h in run.items())


def _row_hashes(out: np.ndarray, placement: np.ndarray, flip: int) -> dict[int, int]:
    """Probe row index -> hash of its output row (XOR `flip`: a distorted candidate)."""
    flat = np.ascontiguousarray(out.reshape(out.shape[0], -1))
    return {int(i): _digest(flat[r].tobytes()) ^ flip for r, i in enumerate(placement)}


def _digest(data: bytes) -> int:
    """A row's fingerprint, the same in every process (a stored probe is compared later)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _flip(distort: Distort | None, primitive: str, desc: dict[str, Any]) -> int:
    """0, or (a distorted candidate) a value unique to the candidate: its rows then agree
    with no other candidate's, as a kernel that sums in its own order."""
    if distort is None or not distort(primitive, desc):
        return 0
    return hash((primitive, *sorted(desc.items()))) | 1


MIN_PROBED_ROWS = 96  # row results a candidate is checked on, at least (small sizes: more runs)


def _placements(size: int, total: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Which probe rows sit where in the runs of one candidate: the first `size` rows, the
    last `size` rows, then random choices in random order until at least MIN_PROBED_ROWS
    results are checked (each row at several positions; a difference that shows only for
    some data, e.g. an FMA contracted in one kernel and not in another, needs many rows)."""
    if size >= total:
        return [np.arange(total), np.arange(total)[::-1].copy(), rng.permutation(total)]
    out = [np.arange(size), np.arange(total - size, total)]
    while len(out) * size < MIN_PROBED_ROWS or len(out) < 3:
        out.append(rng.permutation(total)[:size])
    return out


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds per call: the best of TIMING_RUNS means over >= 2 ms of back-to-back calls
    (one call of a small product is mostly dispatch noise)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(TIMING_RUNS):
        calls, t0 = 0, time.perf_counter()
        while True:
            jax.block_until_ready(fn())
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= 2e-3 or calls >= 64:
                break
        best = min(best, elapsed / calls)
    return best


def _host(a: np.ndarray, dtype: Any) -> np.ndarray:
    """`a` in `dtype` on the host, converted as jnp.asarray converts it (so the probe inputs'
    bits, and the stored probes' hashes, are what they were when rows were gathered on the
    device). Runs gather their rows from it with numpy and put them on the device: an eager
    device gather per run cost ~2 ms of dispatch (and a compile per shape), two thirds of a
    calibration's time (measured: 7.0 of 11.3 s of a small model's product probes)."""
    return np.asarray(jnp.asarray(a, dtype))


def _probe_product(use: ProductUse, dtype: Any, device: Any, distort: Distort | None,
                   rng: np.random.Generator) -> list[Candidate]:
    sizes = use.sizes
    top = max(sizes)
    all_rows = sorted(set(sizes) | {p for p in PAD_SIZES if p < top})
    x = _host(rng.standard_normal((top, use.local_k)), dtype)
    w_host = rng.standard_normal((use.local_k, use.local_n)) / np.sqrt(use.local_k)
    w = jax.device_put(jnp.asarray(w_host, dtype), device)
    w_t = jax.device_put(jnp.asarray(np.ascontiguousarray(w_host.T), dtype), device)
    kernels = [("plain", all_rows), ("nt", all_rows)]
    w_p = None
    if not use.sharded and _native_products_usable(dtype, device):
        # invariant by construction: no padding to try, each size at its own rows
        kernels.append(("native", sorted(set(sizes))))
        w_p = jax.jit(native_kernels.pack_panels)(w)
    out: list[Candidate] = []
    for kernel, row_counts in kernels:
        fn = jax.jit(lambda a, b, bt, bp, kernel=kernel: product(
            a, b if kernel == "plain" else None, bt if kernel == "nt" else None, kernel,
            a.shape[0], jnp.float32, bp if kernel == "native" else None, use.local_n))
        for rows in row_counts:
            desc = {"kernel": kernel, "rows": rows}
            flip = _flip(distort, "product", {"name": use.name, **desc})
            runs = []
            for placement in _placements(rows, top, rng):
                res = np.asarray(fn(jax.device_put(x[placement], device), w, w_t, w_p))
                runs.append(_row_hashes(res, placement, flip))
            xs = jax.device_put(x[:rows], device)
            out.append(Candidate(desc, rows, runs, _timed(partial(fn, xs, w, w_t, w_p))))
    return out


def _probe_grouped(use: GroupedUse, dtype: Any, device: Any, distort: Distort | None,
                   rng: np.random.Generator) -> list[Candidate]:
    """A grouped product as the MoE layer runs it: every probe row has a fixed expert;
    each run takes a placement of probe rows, sorts them by expert (stably, as moe.py
    does) and computes each row against its expert's matrix. So a row is checked at
    several positions inside groups of several sizes (which rows share its expert changes
    with the placement); its bits must not move."""
    from multiserve.model.families.moe import grouped

    sizes = use.sizes
    top = max(sizes)
    x = _host(rng.standard_normal((top, use.local_k)), dtype)
    experts = _host(rng.integers(0, use.experts, top), jnp.int32)
    w_host = rng.standard_normal((use.experts, use.local_k, use.local_n)) / np.sqrt(use.local_k)
    w = jax.device_put(jnp.asarray(w_host, dtype), device)
    kernels = ["gather"]
    w_p = None
    if not use.sharded and _native_products_usable(dtype, device):
        kernels.insert(0, "native")
        w_p = jax.jit(native_kernels.pack_panels)(w)
    out: list[Candidate] = []
    for kernel in kernels:
        for rows in sorted(set(sizes)):
            plan = ProductPlan(use.name, use.local_k, use.local_n,
                               ((rows, Formulation(kernel, rows)),))

            @jax.jit
            def fn(a: jax.Array, g: jax.Array, b: jax.Array, bp: Any, plan: Any = plan
                   ) -> jax.Array:
                order = jnp.argsort(g, stable=True)
                ys = grouped(a[order], g[order], b, bp, plan, 0)
                return jnp.zeros_like(ys).at[order].set(ys)

            desc = {"kernel": kernel, "rows": rows}
            flip = _flip(distort, "grouped", {"name": use.name, **desc})
            runs = []
            for placement in _placements(rows, top, rng):
                res = np.asarray(fn(jax.device_put(x[placement], device),
                                    jnp.asarray(experts[placement]), w, w_p))
                runs.append(_row_hashes(res, placement, flip))
            xs, gs = jax.device_put(x[:rows], device), jnp.asarray(experts[:rows])
            out.append(Candidate(desc, rows, runs, _timed(partial(fn, xs, gs, w, w_p))))
    return out


def _native_products_usable(dtype: Any, device: Any) -> bool:
    return (native_kernels.supports_products(device.platform, str(jnp.dtype(dtype)))
            and native_kernels.unavailable_reason() is None)


def _probe_row_sum(width: int, counts: tuple[int, ...], device: Any,
                   distort: Distort | None, rng: np.random.Generator) -> list[Candidate]:
    top = max(counts)
    all_rows = sorted(set(counts) | {p for p in PAD_SIZES if p < top})
    x = _host(rng.standard_normal((top, width)), jnp.float32)
    fn = jax.jit(lambda a: row_sum_rows(a, a.shape[0]))
    out = []
    for rows in all_rows:
        desc = {"rows": rows}
        flip = _flip(distort, "row_sum", {"width": width, **desc})
        runs = [_row_hashes(np.asarray(fn(jax.device_put(x[p], device))), p, flip)
                for p in _placements(rows, top, rng)]
        xs = jax.device_put(x[:rows], device)
        out.append(Candidate(desc, rows, runs, _timed(partial(fn, xs))))
    return out


class _AttentionProbe:
    """Paged attention on fixed probe rows: the first half decode-like (each its own
    sequence, random positions over several key blocks), the second half prefill-like
    (runs of consecutive positions of a few sequences), so chunks of one sequence (shared
    keys) occur at the larger sizes. Candidates are compiled on demand and remembered."""

    def __init__(self, use: AttentionUse, dtype: Any, device: Any, distort: Distort | None,
                 rng: np.random.Generator) -> None:
        self.use, self.distort, self.rng = use, distort, rng
        self.top = top = max(use.sizes)
        self.num_seqs = num_seqs = 16
        max_pos = 2 * use.block_size + use.block_size // 2
        pages = -(-(max_pos + 1) // use.page_size)
        slots = (1 + num_seqs * pages) * use.page_size
        self.table = jnp.asarray((1 + np.arange(num_seqs * pages, dtype=np.int32))
                                 .reshape(num_seqs, -1))
        pool_shape = (1, use.kv_heads, slots, use.head_dim)
        self.k_pool = jax.device_put(jnp.asarray(rng.standard_normal(pool_shape), dtype), device)
        self.v_pool = jax.device_put(jnp.asarray(rng.standard_normal(pool_shape), dtype), device)
        half = max(1, top // 2)
        seq = np.zeros(top, np.int32)
        pos = np.zeros(top, np.int32)
        seq[:half] = np.arange(half) % (num_seqs // 2)
        pos[:half] = rng.integers(0, max_pos, half)
        rest = top - half
        if rest:
            per_seq = -(-rest // (num_seqs // 2))
            seq[half:] = num_seqs // 2 + np.arange(rest) // per_seq
            for s in np.unique(seq[half:]):
                idx = np.nonzero(seq[half:] == s)[0] + half
                start = int(rng.integers(0, max(1, max_pos - len(idx))))
                pos[idx] = np.minimum(start + np.arange(len(idx)), max_pos)
        heads = use.kv_heads * use.group
        self.device = device
        self.q = _host(rng.standard_normal((top, heads, use.head_dim)), dtype)
        self.seq, self.pos = seq, pos
        self.done: dict[tuple[int, int, int, bool, str], Candidate] = {}

    def candidate(self, tokens: int, chunk: int, padded: int, shared: bool,
                  kernel: str = "xla") -> Candidate:
        key = (tokens, chunk, padded, shared, kernel)
        if key not in self.done:
            self.done[key] = self._run(*key)
        return self.done[key]

    def native(self, tokens: int) -> Candidate:
        """The native kernel at T tokens (it has no chunking: every row alone)."""
        return self.candidate(tokens, 1, tokens, False, "native")

    def _run(self, tokens: int, chunk: int, padded: int, shared: bool,
             kernel: str) -> Candidate:
        use = self.use
        plan = AttentionPlan(((tokens, (chunk, padded)),), shared, kernel)
        table, k_pool, v_pool, num_seqs = self.table, self.k_pool, self.v_pool, self.num_seqs

        @jax.jit
        def attend(qs: jax.Array, ps: jax.Array, ss: jax.Array) -> jax.Array:
            n = qs.shape[0]
            batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32), positions=ps,
                                 token_seq=ss, out_slots=jnp.zeros(n, jnp.int32),
                                 page_table=table, seq_lens=jnp.zeros(num_seqs, jnp.int32),
                                 logit_rows=jnp.zeros(1, jnp.int32))
            return paged_attention(qs, k_pool, v_pool, 0, batch, page_size=use.page_size,
                                   block_size=use.block_size, plan=plan)

        desc = {"kernel": kernel, "tokens": tokens, "chunk": chunk, "padded": padded,
                "shared_keys": shared}
        flip = _flip(self.distort, "attention", desc)
        runs = []
        t0 = time.perf_counter()
        for p in _placements(tokens, self.top, self.rng):
            res = np.asarray(attend(jax.device_put(self.q[p], self.device),
                                    jnp.asarray(self.pos[p]), jnp.asarray(self.seq[p])))
            runs.append(_row_hashes(res, p, flip))
        # the cost model is static (padded rows, then chunk iterations): timing these tiny
        # probe steps measures dispatch noise, not the step's attention
        return Candidate(desc, tokens, runs, time.perf_counter() - t0)


def _attention_preference(tokens: int, top: int) -> list[tuple[int, int]]:
    """(chunk, padded) candidates for a T-token step, best first: no padding beyond a
    multiple of the chunk, then the largest chunk (fewest iterations); then chunks larger
    than T (T padded up to the chunk), smallest first."""
    fits = [(c, -(-tokens // c) * c) for c in sorted(QUERY_CHUNKS, reverse=True) if c <= tokens]
    fits.sort(key=lambda cp: (cp[1], -cp[0]))
    larger = [(c, c) for c in sorted(QUERY_CHUNKS) if c > tokens and c <= max(top, 1)]
    return fits + larger


def _native_usable(use: AttentionUse, dtype: Any, device: Any) -> bool:
    """Whether the native CPU kernel may be a candidate here (and is built)."""
    return (not use.sharded
            and native_kernels.supports_attention(device.platform, str(jnp.dtype(dtype)),
                                                  use.head_dim)
            and native_kernels.unavailable_reason() is None)


def _choose_attention(use: AttentionUse, dtype: Any, device: Any, distort: Distort | None,
                      rng: np.random.Generator
                      ) -> tuple[Selection, bool, str, list[Candidate]]:
    """The native kernel where it can run and every size's rows equal its own reference
    (it is row-invariant by construction; the probe checks that). Else the XLA
    formulation: the first position-invariant reference in preference order (largest
    chunk, shared keys first) at the largest size; then, for every size, the first
    candidate in preference order whose rows equal the reference's; none: the reference
    itself, the step padded to the largest size (last resort). Candidates are probed
    lazily. Returns (the selection, shared keys, the kernel, every candidate probed)."""
    probe = _AttentionProbe(use, dtype, device, distort, rng)
    top = probe.top
    if _native_usable(use, dtype, device):
        anchor = probe.native(top)
        ref = anchor.runs[0]
        if anchor.agrees(ref):
            choice = {t: probe.native(t) for t in use.sizes}
            if all(c.agrees(ref) for c in choice.values()):
                return (Selection(choice, anchor, True), False, "native",
                        list(probe.done.values()))
        log.warning("the native attention kernel's rows are not invariant on this backend; "
                    "using the XLA formulation")
    for chunk, padded in _attention_preference(top, top):
        for shared in ((True, False) if chunk > 1 else (False,)):
            anchor = probe.candidate(top, chunk, padded, shared)
            ref = anchor.runs[0]
            if not anchor.agrees(ref):
                continue
            choice = {}
            for t in use.sizes:
                prefs = (probe.candidate(t, c, p, shared and c > 1)
                         for c, p in _attention_preference(t, top))
                choice[t] = next((cand for cand in prefs if cand.agrees(ref)), anchor)
            return Selection(choice, anchor, True), shared, "xla", list(probe.done.values())
    first = probe.candidate(top, *_attention_preference(top, top)[0], False)
    return (Selection({t: first for t in use.sizes}, None, False), False, "xla",
            list(probe.done.values()))


# ---- selection -----------------------------------------------------------------------------
TIE = 1.15  # candidates within this factor of the fastest count as equally fast


def _fastest(cands: list[Candidate]) -> Candidate:
    """The fastest candidate; among those within TIE of it (timing noise), the one with
    the fewest rows (least padding), then the plain kernel (it needs no transposed copy
    in the scanned decoder), then the fastest."""
    quickest = min(c.seconds for c in cands)
    return min((c for c in cands if c.seconds <= quickest * TIE),
               key=lambda c: (c.rows, c.desc.get("kernel") == "nt", c.seconds))


@dataclass
class Selection:
    """One primitive's choice: for each needed size the candidate used, the anchor (None:
    no position-invariant reference, so `verified` is False and the choice is merely the
    fastest)."""

    choice: dict[int, Candidate]
    anchor: Candidate | None
    verified: bool


def select(candidates: list[Candidate], sizes: Sequence[int]) -> Selection:
    """The cheapest plan in which every needed size m is served by a member of one anchor's
    class holding at least m rows (module docstring)."""
    top = max(c.rows for c in candidates)
    fastest = {m: min(c.seconds for c in candidates if c.rows >= m) for m in sizes}
    best: tuple[float, Selection] | None = None
    for anchor in (c for c in candidates if c.rows == top):
        ref = anchor.runs[0]
        if not anchor.agrees(ref):
            continue  # its rows depend on where they sit: not a reference
        members = [c for c in candidates if c.agrees(ref)]
        choice = {}
        for m in sizes:
            able = [c for c in members if c.rows >= m]
            if not able:
                break
            choice[m] = _fastest(able)
        else:
            cost = sum(choice[m].seconds / max(fastest[m], 1e-9) for m in sizes)
            if best is None or cost < best[0]:
                best = (cost, Selection(choice, anchor, True))
    if best is not None:
        return best[1]
    # nothing invariant: the fastest candidate per size, flagged
    return Selection({m: _fastest([c for c in candidates if c.rows >= m]) for m in sizes},
                     None, False)


def _table_rows(primitive: str, what: dict[str, Any], candidates: list[Candidate],
                sel: Selection) -> list[dict[str, Any]]:
    """The probe table's rows of one primitive: every candidate, whether its rows stay put
    at other positions, whether it matches the reference, and the sizes it serves."""
    ref = sel.anchor.runs[0] if sel.anchor is not None else None
    return [{"primitive": primitive, **what, **c.desc, "ms": round(c.seconds * 1e3, 4),
             "position_invariant": c.agrees(c.runs[0]),
             "matches_reference": bool(ref is not None and c.agrees(ref)),
             "reference": c is sel.anchor,
             "chosen_for": sorted(m for m, cc in sel.choice.items() if cc is c)}
            for c in candidates]


def _rng(*what: Any) -> np.random.Generator:
    """The probe's own random stream, seeded by what it probes: a probe's data (hence its
    result) does not depend on which probes ran before it, so results can be reused."""
    return np.random.default_rng(zlib.crc32(repr(("multiserve-probe", *what)).encode()))


# Product, grouped and row-sum probes of this process, reused by later workloads with the
# same shapes (the tiny models of a test run, the engines of a fleet with other page sizes),
# and stored in the cache folder's probes/ for other processes (a restart with other
# buckets, a test run's second worker). A probe's result depends only on its key
# (backend, dtype, shape, sizes, sharding) and the software and CPU (_probe_file_key).
_PROBES: dict[tuple[Any, ...], tuple[list[Candidate], Selection]] = {}


def _probe_once(key: tuple[Any, ...], store: dict[tuple[Any, ...], Any],
                probe: Callable[[np.random.Generator], list[Candidate]],
                sizes: Sequence[int]) -> tuple[list[Candidate], Selection]:
    """probe(rng) -> its candidates and their selection over `sizes`, kept in `store` by
    `key` (the process's _PROBES, or one calibration's own dict when it must not reuse
    other calibrations' probes: a distorted probe, use_cache=False)."""
    if key not in store:
        if store is _PROBES:  # reusable: also through the disk, between processes
            file_key = _probe_file_key(key)
            cands = _filled_once(
                cache_dir() / "probes" / f"{_hash_key(file_key)}.json", file_key,
                lambda d: [Candidate(c["desc"], int(c["rows"]),
                                     [{int(i): int(h) for i, h in run.items()}
                                      for run in c["runs"]], float(c["seconds"]))
                           for c in d["candidates"]],
                lambda: probe(_rng(*key)),
                lambda cands: {"candidates": [{"desc": c.desc, "rows": c.rows, "runs": c.runs,
                                               "seconds": c.seconds} for c in cands]})
        else:
            cands = probe(_rng(*key))
        store[key] = (cands, select(cands, sizes))
    return store[key]


def _probe_file_key(key: tuple[Any, ...]) -> dict[str, Any]:
    """What a stored probe's result depends on: the probe's key (backend, dtype, shape,
    sizes, sharding) and the software and CPU it ran on."""
    import jaxlib

    return {"probe_version": PROBE_VERSION, "probe": repr(key), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cpu": native_kernels.cpu_facts()}


# ---- cache files: a plan per workload, a probe per shape ----------------------------------
def _filled_once(path: Path, key: dict[str, Any], decode: Callable[[dict[str, Any]], Any],
                 make: Callable[[], Any], encode: Callable[[Any], dict[str, Any]]) -> Any:
    """decode(the entry of `path`) if the file holds one written for `key`; else make() it
    (one process at a time: a lock file beside it; a process that waited reads the first
    one's result) and store encode(value) there."""
    value = _read_entry(path, key, decode)
    if value is None:
        with exclusive(path.with_suffix(".lock")):
            value = _read_entry(path, key, decode)  # made while we waited?
            if value is None:
                value = make()
                _write_entry(path, key, encode(value))
    return value


def _read_entry(path: Path, key: dict[str, Any], decode: Callable[[dict[str, Any]], Any]
                ) -> Any:
    """decode(the file's entry), or None: no file, another key's, or unreadable (warned)."""
    try:
        d = json.loads(path.read_text())
        return decode(d) if d.get("key") == json.loads(json.dumps(key)) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable invariance cache %s: %s", path, exc)
        return None


def _write_entry(path: Path, key: dict[str, Any], body: dict[str, Any]) -> None:
    """{"key": key, **body} into `path`, atomically (a temporary file renamed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, **body}))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write the invariance cache %s: %s", path, exc)


def _choose(workload: Workload, device: Any, distort: Distort | None, memo: bool = False
            ) -> tuple[InvariancePlan, list[dict[str, Any]]]:
    dtype = jnp.dtype(workload.dtype)
    # what a probe's result depends on besides its shape (the kernels' build among them)
    backend = (device.platform, getattr(device, "device_kind", ""), str(dtype),
               native_kernels.build_id() if device.platform == "cpu" else None)
    store = _PROBES if memo and distort is None else {}
    table: list[dict[str, Any]] = []
    problems: list[str] = []
    products = []
    for use in workload.products:
        key = (*backend, "product", use.local_k, use.local_n, use.sizes, use.sharded,
               use.name if distort else "")
        cands, sel = _probe_once(
            key, store, lambda rng, use=use: _probe_product(use, dtype, device, distort, rng),
            use.sizes)
        if not sel.verified:
            problems.append(f"product {use.name} ({use.local_k}x{use.local_n}): no "
                            f"formulation gives position-invariant rows")
        table += _table_rows("product", {"name": use.name, "shape": f"{use.k}x{use.n}"},
                             cands, sel)
        products.append(ProductPlan(use.name, use.k, use.n, tuple(
            (m, Formulation(c.desc["kernel"], c.rows)) for m, c in sorted(sel.choice.items()))))
    for guse in workload.grouped:
        cands, sel = _probe_once(
            (*backend, "grouped", repr(guse)), store,
            lambda rng, guse=guse: _probe_grouped(guse, dtype, device, distort, rng),
            guse.sizes)
        if not sel.verified:
            problems.append(f"grouped product {guse.name} ({guse.local_k}x{guse.local_n}): "
                            "no formulation gives position-invariant rows")
        table += _table_rows("grouped", {"name": guse.name, "shape": f"{guse.k}x{guse.n}"},
                             cands, sel)
        products.append(ProductPlan(guse.name, guse.k, guse.n, tuple(
            (m, Formulation(c.desc["kernel"], c.rows)) for m, c in sorted(sel.choice.items()))))
    row_sums = []
    for width, counts in workload.row_sums:
        cands, sel = _probe_once(
            (*backend, "row_sum", width, counts), store,
            lambda rng, width=width, counts=counts: _probe_row_sum(width, counts, device,
                                                                   distort, rng), counts)
        if not sel.verified:
            problems.append(f"row sums of width {width}: not position-invariant")
        table += _table_rows("row_sum", {"width": width}, cands, sel)
        row_sums.append(RowSumPlan(width, tuple((m, c.rows)
                                                for m, c in sorted(sel.choice.items()))))
    sel, shared, kernel, cands = _choose_attention(
        workload.attention, dtype, device, distort,
        _rng(*backend, "attention", repr(workload.attention)))
    if not sel.verified:
        problems.append("attention: no query chunking gives position-invariant rows")
    table += _table_rows("attention", {}, cands, sel)
    attention = AttentionPlan(tuple((t, (c.desc["chunk"], c.desc["padded"]))
                                    for t, c in sorted(sel.choice.items())), shared, kernel)
    plan = InvariancePlan(tuple(products), tuple(row_sums), attention,
                          verified=not problems, problems=tuple(problems))
    return plan, table


# ---- the key and the cache -----------------------------------------------------------------
def backend_key(device: Any, workload: Workload) -> dict[str, Any]:
    """What decides which kernels run: the device, the CPU, the software, the shapes."""
    import jaxlib

    key: dict[str, Any] = {
        "probe_version": PROBE_VERSION,
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", ""),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "workload": asdict(workload),
    }
    if not workload.grouped:  # a dense model's key stays what it was before MoE existed
        del key["workload"]["grouped"]
    if device.platform == "cpu":
        key["cpu"] = native_kernels.cpu_facts()
        # a plan naming the native kernels is only valid where they build, as built
        key["native_kernels"] = native_kernels.build_id()
    return key


def _hash_key(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    return cache_root() / "invariance"


_MEMO: dict[str, Calibration] = {}
_LOCK = threading.Lock()  # one probe at a time per process (a fleet's engines share it)


def calibrate(workload: Workload, device: Any, *, distort: Distort | None = None,
              use_cache: bool = True) -> Calibration:
    """The invariance plan for `workload` on `device`'s backend: from this process's memo,
    else the cache file, else probed now (and cached). A distorted probe is never cached.
    One process probes a key at a time (a lock file beside the cache file): another process
    wanting the same plan meanwhile waits and reads the file."""
    key = backend_key(device, workload)
    key_hash = _hash_key(key)
    cacheable = use_cache and distort is None
    with _LOCK:
        if cacheable and key_hash in _MEMO:
            return _MEMO[key_hash]
        if not cacheable:
            return _probe(workload, device, distort, key, key_hash, use_cache)
        cal = _filled_once(
            cache_dir() / f"{key_hash}.json", key,
            lambda d: Calibration(InvariancePlan.from_json(d["plan"]), key, key_hash,
                                  float(d["probe_seconds"]), True, tuple(d["table"])),
            lambda: _probe(workload, device, distort, key, key_hash, use_cache),
            lambda c: {"plan": c.plan.to_json(), "probe_seconds": c.probe_seconds,
                       "table": c.table})
        _MEMO[key_hash] = cal
        return cal


def _probe(workload: Workload, device: Any, distort: Distort | None, key: dict[str, Any],
           key_hash: str, use_cache: bool) -> Calibration:
    t0 = time.monotonic()
    plan, table = _choose(workload, device, distort, memo=use_cache)
    cal = Calibration(plan, key, key_hash, time.monotonic() - t0, False, tuple(table))
    if not plan.verified:
        log.error("DETERMINISM NOT VERIFIED on this backend: %s", "; ".join(plan.problems))
    return cal


def default_workload(cfg: Any, dtype: Any = np.float32, *, page_size: int | None = None,
                     block_size: int | None = None, tp: int = 1,
                     moe_sharding: str = "tensor") -> Workload:
    """The workload of an engine with the default EngineConfig buckets."""
    from multiserve.config import EngineConfig

    ec = EngineConfig()
    return workload_for(cfg, ec.precompile_token_paddings, ec.precompile_bs_paddings,
                        max(ec.precompile_bs_paddings), page_size or ec.page_size,
                        block_size or ec.attention_block_size, dtype, tp=tp,
                        moe_sharding=moe_sharding)


def default_plan(cfg: Any, dtype: Any = np.float32, *, page_size: int | None = None,
                 block_size: int | None = None, device: Any = None) -> InvariancePlan:
    """The plan of an engine with the default EngineConfig buckets on `device` (default:
    the first device), for code that runs the model outside an engine and must share a
    default engine's numerics bit for bit (simple_generate, reference loops in tests)."""
    workload = default_workload(cfg, dtype, page_size=page_size, block_size=block_size)
    return calibrate(workload, device if device is not None else jax.devices()[0]).plan
