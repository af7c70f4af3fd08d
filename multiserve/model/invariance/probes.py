"""The probes: candidate formulations of each primitive run on random data, every probe row
placed at several positions, each run's output rows hashed (`Candidate.runs`) and the
candidate timed. What to choose from them is choice.py's job; this file only measures.

- products (`probe_product`): kernel "plain" (x @ W) and "nt" (x . W^T), each at every
  engine size and at PAD_SIZES rows (a smaller M can be zero-padded up to any of them); and
  where it builds (CPU, float32 or bfloat16, one device) the native kernel
  (model/kernels/native.py) at every engine size (invariant by construction: one class, no
  padding), in bfloat16 once per instruction path the calibration may choose
  (`native_paths`: each path its own class, its own bits);
- grouped expert products (`probe_grouped`): "gather" and, where it builds, "native", at
  every routed-pair count, the rows sorted by expert as the MoE layer sorts them;
- row sums (`probe_row_sum`): the ones-product padded to every count used and to PAD_SIZES;
- attention (`AttentionProbe`): paged attention on fixed probe rows, candidates (the
  native CPU kernel, a GPU's or TPU's Pallas kernel, the XLA formulation's query chunkings with and without shared keys)
  made on demand.

Every probe compiles with the XLA options of the steps it verifies (`probe_jit`:
xla_options.step_options of the model's dtype), never XLA's defaults.

A probe's random data comes from its own stream (`probe_rng`), seeded by what it probes,
so its result does not depend on which probes ran before it and can be stored and reused.

`Distort` (tests and `multiserve doctor --alien`): a predicate over (primitive, candidate)
naming candidates whose rows should be treated as computed differently (their hashes are
changed), so a test can make the probe see an alien backend.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.invariance.choice import Candidate
from multiserve.model.invariance.plan import AttentionPlan, Formulation, ProductPlan
from multiserve.model.invariance.primitives import grouped, product, row_sum_rows
from multiserve.model.invariance.workload import AttentionUse, GroupedUse, ProductUse
from multiserve.model.invariance.xla_options import step_options
from multiserve.model.kernels import native as native_kernels
from multiserve.model.kernels.grouped_tpu import gmm_usable
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_pallas import KERNEL_PLATFORM, forced_kernel
from multiserve.model.layers.attention_terms import AttentionTerms
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import pool_layout, to_lanes

PAD_SIZES = (2, 4, 8, 16, 32, 64)  # extra row counts a small step may be padded to
TIMING_RUNS = 3
MIN_PROBED_ROWS = 96  # row results a candidate is checked on, at least (small sizes: more runs)
# A product's row holds one result per output column, each its own sum: a wide product
# checks as many sums in fewer rows. Its rows checked, at least: this many results over its
# width (the MIN_PROBED_ROWS of a 64-column product; never more rows than that).
MIN_PROBED_RESULTS = MIN_PROBED_ROWS * 64
# (primitive, candidate description) -> treat this candidate's rows as different
Distort = Callable[[str, dict[str, Any]], bool]


# ---- rows, placements, timing --------------------------------------------------------------
def row_hashes(out: np.ndarray, placement: np.ndarray, flip: int) -> dict[int, int]:
    """Probe row index -> hash of its output row (XOR `flip`: a distorted candidate)."""
    flat = np.ascontiguousarray(out.reshape(out.shape[0], -1))
    return {int(i): digest(flat[r].tobytes()) ^ flip for r, i in enumerate(placement)}


def digest(data: bytes) -> int:
    """A row's fingerprint, the same in every process (a stored probe is compared later)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def distortion(distort: Distort | None, primitive: str, desc: dict[str, Any]) -> int:
    """0, or (a distorted candidate) a value unique to the candidate, XORed into its row
    hashes: its rows then agree with no other candidate's, as a kernel that sums in its own
    order."""
    if distort is None or not distort(primitive, desc):
        return 0
    return hash((primitive, *sorted(desc.items()))) | 1


def placements(size: int, total: int, rng: np.random.Generator,
               min_rows: int = MIN_PROBED_ROWS) -> list[np.ndarray]:
    """Which probe rows sit where in the runs of one candidate: the first `size` rows, the
    last `size` rows, then random choices in random order until at least `min_rows` row
    results are checked (each row at several positions; a difference that shows only for
    some data, e.g. an FMA contracted in one kernel and not in another, needs many sums).
    At least 3 placements whatever the size."""
    if size >= total:
        return [np.arange(total), np.arange(total)[::-1].copy(), rng.permutation(total)]
    out = [np.arange(size), np.arange(total - size, total)]
    while len(out) * size < min_rows or len(out) < 3:
        out.append(rng.permutation(total)[:size])
    return out


def _mean_seconds(fn: Callable[[], Any]) -> float:
    """Seconds per call over >= 2 ms of back-to-back calls (one call of a small product is
    mostly dispatch noise; at most 64 calls)."""
    calls, t0 = 0, time.perf_counter()
    while True:
        jax.block_until_ready(fn())
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= 2e-3 or calls >= 64:
            return elapsed / calls


def timed(fns: Sequence[Callable[[], Any]]) -> list[float]:
    """Seconds per call of each of `fns`: the best of TIMING_RUNS means (`_mean_seconds`),
    the fns timed in turns (one round: each once), so a slow period of the machine falls on
    every candidate of a probe alike instead of on the ones timed during it."""
    for fn in fns:
        jax.block_until_ready(fn())
    best = [float("inf")] * len(fns)
    for _ in range(TIMING_RUNS):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], _mean_seconds(fn))
    return best


# A probed candidate before timing: (desc, rows, runs, the call to time), Candidate's fields
# but its time
Pending = tuple[dict[str, Any], int, list[dict[int, int]], Callable[[], Any]]


def timed_candidates(pending: Sequence[Pending]) -> list[Candidate]:
    """Candidates (desc, rows, runs) with their times, their fns timed together (`timed`)."""
    seconds = timed([fn for *_, fn in pending])
    return [Candidate(desc, rows, runs, t)
            for (desc, rows, runs, _), t in zip(pending, seconds, strict=True)]


def product_rows(width: int) -> int:
    """The rows a product of `width` output columns is checked on, at least: as many sums as
    MIN_PROBED_RESULTS (a 64-column product's MIN_PROBED_ROWS; wider ones fewer rows)."""
    return max(1, min(MIN_PROBED_ROWS, -(-MIN_PROBED_RESULTS // width)))


def host(a: np.ndarray, dtype: Any) -> np.ndarray:
    """`a` in `dtype` on the host, converted as jnp.asarray converts it (so the probe inputs'
    bits, and the stored probes' hashes, are what they were when rows were gathered on the
    device). Runs gather their rows from it with numpy and put them on the device: an eager
    device gather per run costs a dispatch (and a compile per shape), which was most of a
    calibration's time (docs/performance.md §6)."""
    return np.asarray(jnp.asarray(a, dtype))


def probe_rng(*what: Any) -> np.random.Generator:
    """The probe's own random stream, seeded by what it probes: a probe's data (hence its
    result) does not depend on which probes ran before it, so results can be reused."""
    return np.random.default_rng(zlib.crc32(repr(("multiserve-probe", *what)).encode()))


def probe_jit(fn: Callable[..., Any], dtype: Any, device: Any) -> Callable[..., Any]:
    """`fn` jitted with the XLA options of the step programs of a `dtype` model on
    `device`'s platform: the probe then runs the machine code the steps will run."""
    return jax.jit(fn, compiler_options=step_options(device.platform, str(jnp.dtype(dtype))))


def native_products_usable(dtype: Any, device: Any) -> bool:
    """Whether the native product kernels may be candidates here (and are built)."""
    name = str(jnp.dtype(dtype))
    return (native_kernels.supports_products(device.platform, name)
            and native_kernels.unavailable_reason(name) is None)


def pallas_attention_kernel(use: AttentionUse, device: Any) -> tuple[str, bool] | None:
    """(the Pallas attention kernel that may be a candidate here, whether it runs in
    interpret mode), or None: "pallas_gpu" on a GPU, "pallas_tpu" on a TPU, or the kernel
    forced by MULTISERVE_ATTENTION_KERNEL (attention_pallas.forced_kernel), interpreted on a
    platform it was not made for. Not for a tensor-parallel attention (a pallas_call is not
    partitioned by GSPMD). Both kernels compute every attention term."""
    if use.sharded:
        return None
    forced = forced_kernel()
    kernel = forced or {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(device.platform)
    if kernel is None:
        return None
    return kernel, KERNEL_PLATFORM[kernel] != device.platform


def native_paths(dtype: Any) -> tuple[str, ...]:
    """The native products' instruction paths to probe at `dtype`: every bfloat16 path
    the calibration may choose (native.bf16_path_candidates), or "" (float32: one path)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return native_kernels.bf16_path_candidates()
    return ("",)


def native_attention_usable(use: AttentionUse, dtype: Any, device: Any) -> bool:
    """Whether the native CPU attention kernel may be a candidate here (and is built)."""
    name = str(jnp.dtype(dtype))
    return (not use.sharded
            and native_kernels.supports_attention(device.platform, name, use.head_dim)
            and native_kernels.unavailable_reason(name) is None)


# ---- the probes ----------------------------------------------------------------------------
def probe_product(use: ProductUse, dtype: Any, device: Any, distort: Distort | None,
                  rng: np.random.Generator) -> list[Candidate]:
    """Every formulation of one dense product at every row count it may run at."""
    sizes = use.sizes
    top = max(sizes)
    all_rows = sorted(set(sizes) | {p for p in PAD_SIZES if p < top})
    x = host(rng.standard_normal((top, use.local_k)), dtype)
    w_host = rng.standard_normal((use.local_k, use.local_n)) / np.sqrt(use.local_k)
    w = jax.device_put(jnp.asarray(w_host, dtype), device)
    w_t = jax.device_put(jnp.asarray(np.ascontiguousarray(w_host.T), dtype), device)
    kernels = [("plain", "", all_rows), ("nt", "", all_rows)]
    w_p = None
    if not use.sharded and native_products_usable(dtype, device):
        # invariant by construction: no padding to try, each size at its own rows
        kernels += [("native", path, sorted(set(sizes))) for path in native_paths(dtype)]
        w_p = jax.jit(native_kernels.pack_panels)(w)
    pending: list[Pending] = []
    for kernel, path, row_counts in kernels:
        fn = probe_jit(lambda a, b, bt, bp, kernel=kernel, path=path: product(
            a, b if kernel == "plain" else None, bt if kernel == "nt" else None, kernel,
            a.shape[0], jnp.float32, bp if kernel == "native" else None, use.local_n,
            path=path), dtype, device)
        for rows in row_counts:
            desc = {"kernel": kernel, "rows": rows, **({"path": path} if path else {})}
            flip = distortion(distort, "product", {"name": use.name, **desc})
            runs = []
            for placement in placements(rows, top, rng, product_rows(use.local_n)):
                res = np.asarray(fn(jax.device_put(x[placement], device), w, w_t, w_p))
                runs.append(row_hashes(res, placement, flip))
            xs = jax.device_put(x[:rows], device)
            pending.append((desc, rows, runs, partial(fn, xs, w, w_t, w_p)))
    return timed_candidates(pending)


def probe_grouped(use: GroupedUse, dtype: Any, device: Any, distort: Distort | None,
                  rng: np.random.Generator) -> list[Candidate]:
    """A grouped product as the MoE layer runs it (model/families/moe.py): every probe row
    has a fixed expert; each run takes a placement of probe rows, sorts them by expert
    (stably, as the layer does) and computes each row against its expert's matrix
    (`primitives.grouped`). So a row is checked at several positions inside groups of
    several sizes (which rows share its expert changes with the placement); its bits must
    not move."""
    sizes = use.sizes
    top = max(sizes)
    x = host(rng.standard_normal((top, use.local_k)), dtype)
    experts = host(rng.integers(0, use.experts, top), jnp.int32)
    w_host = rng.standard_normal((use.experts, use.local_k, use.local_n)) / np.sqrt(use.local_k)
    w = jax.device_put(jnp.asarray(w_host, dtype), device)
    kernels = [("gather", "")]
    if gmm_usable(device.platform, use.sharded):  # the TPU's grouped matmul
        kernels = [("gmm", ""), *kernels]
    w_p = None
    if not use.sharded and native_products_usable(dtype, device):
        kernels = [("native", path) for path in native_paths(dtype)] + kernels
        w_p = jax.jit(native_kernels.pack_panels)(w)
    pending: list[Pending] = []
    for kernel, path in kernels:
        for rows in sorted(set(sizes)):
            plan = ProductPlan(use.name, use.local_k, use.local_n,
                               ((rows, Formulation(kernel, rows, path)),))

            def run(a: jax.Array, g: jax.Array, b: jax.Array, bp: Any, plan: Any = plan
                    ) -> jax.Array:
                order = jnp.argsort(g, stable=True)
                ys = grouped(a[order], g[order], b, bp, plan, 0)
                return jnp.zeros_like(ys).at[order].set(ys)

            fn = probe_jit(run, dtype, device)

            desc = {"kernel": kernel, "rows": rows, **({"path": path} if path else {})}
            flip = distortion(distort, "grouped", {"name": use.name, **desc})
            runs = []
            for placement in placements(rows, top, rng, product_rows(use.local_n)):
                res = np.asarray(fn(jax.device_put(x[placement], device),
                                    jnp.asarray(experts[placement]), w, w_p))
                runs.append(row_hashes(res, placement, flip))
            xs, gs = jax.device_put(x[:rows], device), jnp.asarray(experts[:rows])
            pending.append((desc, rows, runs, partial(fn, xs, gs, w, w_p)))
    return timed_candidates(pending)


def probe_row_sum(width: int, counts: tuple[int, ...], dtype: Any, device: Any,
                  distort: Distort | None, rng: np.random.Generator) -> list[Candidate]:
    """The row sums of one width (RMSNorm) padded to every row count they may run at
    (float32 rows whatever the model's `dtype`, which chooses the XLA options)."""
    top = max(counts)
    all_rows = sorted(set(counts) | {p for p in PAD_SIZES if p < top})
    x = host(rng.standard_normal((top, width)), jnp.float32)
    fn = probe_jit(lambda a: row_sum_rows(a, a.shape[0]), dtype, device)
    pending: list[Pending] = []
    for rows in all_rows:
        desc = {"rows": rows}
        flip = distortion(distort, "row_sum", {"width": width, **desc})
        runs = [row_hashes(np.asarray(fn(jax.device_put(x[p], device))), p, flip)
                for p in placements(rows, top, rng)]
        xs = jax.device_put(x[:rows], device)
        pending.append((desc, rows, runs, partial(fn, xs)))
    return timed_candidates(pending)


class AttentionProbe:
    """Paged attention on fixed probe rows: the first half decode-like (each its own
    sequence, random positions over several key blocks), the second half prefill-like
    (runs of consecutive positions of a few sequences), so chunks of one sequence (shared
    keys) occur at the larger sizes. A row's result is its output under every attention
    kind of the model (`AttentionUse.kinds`, side by side; a window probed at most half the
    probe's positions, so that it bites: the kernels' code does not depend on its size).
    Candidates are made on demand and remembered (`done`, in the order they were made)."""

    def __init__(self, use: AttentionUse, dtype: Any, device: Any, distort: Distort | None,
                 rng: np.random.Generator) -> None:
        self.use, self.dtype, self.distort, self.rng = use, dtype, distort, rng
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
        self.q = host(rng.standard_normal((top, heads, use.head_dim)), dtype)
        self.seq, self.pos = seq, pos
        sinks = (jnp.asarray(rng.standard_normal(heads), jnp.float32)
                 if any(with_sinks for _, with_sinks in use.kinds) else None)
        self.terms = [AttentionTerms(window=min(window, max_pos // 2),
                                     sinks=sinks if with_sinks else None,
                                     softcap=use.softcap)
                      for window, with_sinks in (use.kinds or ((0, False),))]
        self.done: dict[tuple[int, int, int, bool, str], Candidate] = {}
        self.interpret = False  # the Pallas candidates run in interpret mode (`pallas`)

    def candidate(self, tokens: int, chunk: int, padded: int, shared: bool,
                  kernel: str = "xla") -> Candidate:
        """The formulation `kernel` at T tokens (query chunk, padded count, shared keys)."""
        key = (tokens, chunk, padded, shared, kernel)
        if key not in self.done:
            self.done[key] = self._run(*key)
        return self.done[key]

    def native(self, tokens: int) -> Candidate:
        """The native kernel at T tokens (it has no chunking: every row alone)."""
        return self.candidate(tokens, 1, tokens, False, "native")

    def pallas(self, kernel: str, interpret: bool) -> Callable[[int], Candidate]:
        """The Pallas kernel `kernel` at T tokens, as `native` (every row alone)."""
        self.interpret = interpret
        return lambda tokens: self.candidate(tokens, 1, tokens, False, kernel)

    def _run(self, tokens: int, chunk: int, padded: int, shared: bool,
             kernel: str) -> Candidate:
        use = self.use
        plan = AttentionPlan(((tokens, (chunk, padded)),), shared, kernel,
                             self.interpret and kernel.startswith("pallas"))
        table, k_pool, v_pool, num_seqs = self.table, self.k_pool, self.v_pool, self.num_seqs
        if pool_layout(kernel) == "lanes":  # the same values in the kernel's layout
            k_pool, v_pool = to_lanes(k_pool), to_lanes(v_pool)

        def attend_rows(qs: jax.Array, ps: jax.Array, ss: jax.Array) -> jax.Array:
            n = qs.shape[0]
            batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32), positions=ps,
                                 token_seq=ss, out_slots=jnp.zeros(n, jnp.int32),
                                 page_table=table, seq_lens=jnp.zeros(num_seqs, jnp.int32),
                                 logit_rows=jnp.zeros(1, jnp.int32))
            return jnp.concatenate([
                paged_attention(qs, k_pool, v_pool, 0, batch, page_size=use.page_size,
                                block_size=use.block_size, plan=plan, terms=terms,
                                kv_heads=use.kv_heads)
                for terms in self.terms], axis=-1)

        attend = probe_jit(attend_rows, self.dtype, self.device)

        desc = {"kernel": kernel, "tokens": tokens, "chunk": chunk, "padded": padded,
                "shared_keys": shared}
        flip = distortion(self.distort, "attention", desc)
        runs = []
        t0 = time.perf_counter()
        for p in placements(tokens, self.top, self.rng):
            res = np.asarray(attend(jax.device_put(self.q[p], self.device),
                                    jnp.asarray(self.pos[p]), jnp.asarray(self.seq[p])))
            runs.append(row_hashes(res, p, flip))
        # the cost model is static (padded rows, then chunk iterations): timing these tiny
        # probe steps measures dispatch noise, not the step's attention
        return Candidate(desc, tokens, runs, time.perf_counter() - t0)
