"""Calibration: the engine measures its own invariance plan on the backend it runs on.

For every primitive a step uses (each layer matrix and the output head at every row count
the engine runs, a MoE family's grouped expert products, the RMSNorm row sums, paged
attention at every token count: the `Workload`, workload.py), candidate formulations are run
on random data with every probe row placed at several positions (probes.py), and the plan
keeps, per primitive, formulations whose rows agree BITWISE with one position-invariant
reference at every size (choice.py). A bfloat16 plan on the CPU runs one instruction path
(avx512_bf16, widen, amx: whichever this CPU runs) in every native product, the one whose
plans cost least by the probes' timings (choice.choose_path). The attention prefers the
native CPU kernel where it builds and verifies (it reads K/V in place where the XLA
formulation materialises every key block: docs/performance.md §5), on a GPU or TPU JAX's
Pallas paged-attention kernel
(layers/attention_pallas.py), else the XLA formulation's query chunking. A primitive
with no position-invariant reference makes the plan unverified (`verified=False`,
`problems`), loudly.

The plan is cached per workload and backend, and each product, grouped and row-sum probe
on its own (store.py): a second start with the same key probes nothing, and a workload that
differs only elsewhere (another page size, other buckets of the same shapes) re-probes only
what differs, in any process. One process probes a key at a time (a lock file).

`distort` (tests and `multiserve doctor --alien`, probes.Distort): makes the probe see an
alien backend; a distorted calibration is never cached and reuses no probe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.model.invariance import probes, store
from multiserve.model.invariance.choice import (
    Candidate,
    Selection,
    choose_attention,
    choose_path,
    of_path,
    select,
    table_rows,
)
from multiserve.model.invariance.plan import (
    AttentionPlan,
    Calibration,
    Formulation,
    InvariancePlan,
    ProductPlan,
    RowSumPlan,
)
from multiserve.model.invariance.probes import Distort
from multiserve.model.invariance.workload import AttentionUse, Workload, default_workload
from multiserve.model.invariance.xla_options import step_options
from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.attention import QUERY_CHUNKS

log = logging.getLogger("multiserve.calibration")

# Product, grouped and row-sum probes of this process, reused by later workloads with the
# same shapes (the tiny models of a test run, the engines of a fleet with other page sizes),
# and stored in the cache folder's probes/ for other processes (a restart with other
# buckets, a test run's second worker). A probe's result depends only on its key
# (backend, dtype, shape, sizes, sharding) and the software and CPU (store.probe_file_key).
_PROBES: dict[tuple[Any, ...], list[Candidate]] = {}
_MEMO: dict[str, Calibration] = {}
_LOCK = threading.Lock()  # one probe at a time per process (a fleet's engines share it)


def calibrate(workload: Workload, device: Any, *, distort: Distort | None = None,
              use_cache: bool = True) -> Calibration:
    """The invariance plan for `workload` on `device`'s backend: from this process's memo,
    else the cache file, else probed now (and cached). A distorted probe is never cached.
    One process probes a key at a time (a lock file beside the cache file): another process
    wanting the same plan meanwhile waits and reads the file."""
    key = store.backend_key(device, workload)
    key_hash = store.hash_key(key)
    cacheable = use_cache and distort is None
    with _LOCK:
        if cacheable and key_hash in _MEMO:
            return _MEMO[key_hash]
        if not cacheable:
            return _probe(workload, device, distort, key, key_hash, use_cache)
        cal = store.filled_once(
            store.cache_dir() / f"{key_hash}.json", key,
            lambda d: Calibration(InvariancePlan.from_json(d["plan"]), key, key_hash,
                                  float(d["probe_seconds"]), True, tuple(d["table"])),
            lambda: _probe(workload, device, distort, key, key_hash, use_cache),
            lambda c: {"plan": c.plan.to_json(), "probe_seconds": c.probe_seconds,
                       "table": c.table})
        _MEMO[key_hash] = cal
        return cal


def default_plan(cfg: Any, dtype: Any = np.float32, *, page_size: int | None = None,
                 block_size: int | None = None, device: Any = None) -> InvariancePlan:
    """The plan of an engine with the default EngineConfig buckets on `device` (default:
    the first device), for code that runs the model outside an engine and must share a
    default engine's numerics bit for bit (simple_generate, reference loops in tests)."""
    workload = default_workload(cfg, dtype, page_size=page_size, block_size=block_size)
    return calibrate(workload, device if device is not None else jax.devices()[0]).plan


def _probe(workload: Workload, device: Any, distort: Distort | None, key: dict[str, Any],
           key_hash: str, use_cache: bool) -> Calibration:
    t0 = time.monotonic()
    plan, table = _choose(workload, device, distort, memo=use_cache)
    cal = Calibration(plan, key, key_hash, time.monotonic() - t0, False, tuple(table))
    if not plan.verified:
        log.error("DETERMINISM NOT VERIFIED on this backend: %s", "; ".join(plan.problems))
    return cal


def _probe_once(key: tuple[Any, ...], memo: dict[tuple[Any, ...], Any],
                probe: Callable[[np.random.Generator], list[Candidate]]) -> list[Candidate]:
    """probe(rng) -> its candidates, kept in `memo` by `key` (the process's _PROBES, or
    one calibration's own dict when it must not reuse other calibrations' probes: a
    distorted probe, use_cache=False)."""
    if key not in memo:
        if memo is _PROBES:  # reusable: also through the disk, between processes
            file_key = store.probe_file_key(key)
            memo[key] = store.filled_once(store.probe_path(file_key), file_key,
                                          store.candidates_from_json,
                                          lambda: probe(probes.probe_rng(*key)),
                                          store.candidates_to_json)
        else:
            memo[key] = probe(probes.probe_rng(*key))
    return memo[key]


def _choose(workload: Workload, device: Any, distort: Distort | None, memo: bool = False
            ) -> tuple[InvariancePlan, list[dict[str, Any]]]:
    """Probe every primitive of `workload` and choose its plan; also the probe table."""
    dtype = jnp.dtype(workload.dtype)
    # the native products' instruction paths probed ("": float32, or no native kernel)
    paths = probes.native_paths(dtype) if device.platform == "cpu" else ("",)
    # what a probe's result depends on besides its shape (the kernels' build and the
    # programs' XLA options among them)
    backend = (device.platform, getattr(device, "device_kind", ""), str(dtype),
               native_kernels.build_id() if device.platform == "cpu" else None,
               tuple(sorted(step_options(device.platform, str(dtype)).items())))
    if paths != ("",):  # which bfloat16 paths the probes time (each its own bits)
        backend += (paths,)
    probed = _PROBES if memo and distort is None else {}
    table: list[dict[str, Any]] = []
    problems: list[str] = []
    matrices: list[tuple[str, Any, list[Candidate]]] = []  # (primitive, use, candidates)
    for use in workload.products:
        key = (*backend, "product", use.local_k, use.local_n, use.sizes, use.sharded,
               use.name if distort else "")
        matrices.append(("product", use, _probe_once(
            key, probed,
            lambda rng, use=use: probes.probe_product(use, dtype, device, distort, rng))))
    for guse in workload.grouped:
        matrices.append(("grouped", guse, _probe_once(
            (*backend, "grouped", repr(guse)), probed,
            lambda rng, guse=guse: probes.probe_grouped(guse, dtype, device, distort, rng))))
    path, costs = choose_path([(cands, use.sizes) for _, use, cands in matrices], paths)
    table += [{"primitive": "bf16_path", "path": p, "cost": round(c, 3), "chosen": p == path}
              for p, c in costs.items()]
    products = []
    for primitive, use, cands in matrices:
        sel = select(of_path(cands, path), use.sizes)
        if not sel.verified:
            what = "product" if primitive == "product" else "grouped product"
            problems.append(f"{what} {use.name} ({use.local_k}x{use.local_n}): no "
                            f"formulation gives position-invariant rows")
        table += table_rows(primitive, {"name": use.name, "shape": f"{use.k}x{use.n}"},
                            cands, sel)
        products.append(ProductPlan(use.name, use.k, use.n, tuple(
            (m, Formulation(c.desc["kernel"], c.rows, c.desc.get("path", "")))
            for m, c in sorted(sel.choice.items()))))
    row_sums = []
    for width, counts in workload.row_sums:
        cands = _probe_once(
            (*backend, "row_sum", width, counts), probed,
            lambda rng, width=width, counts=counts: probes.probe_row_sum(
                width, counts, dtype, device, distort, rng))
        sel = select(cands, counts)
        if not sel.verified:
            problems.append(f"row sums of width {width}: not position-invariant")
        table += table_rows("row_sum", {"width": width}, cands, sel)
        row_sums.append(RowSumPlan(width, tuple((m, c.rows)
                                                for m, c in sorted(sel.choice.items()))))
    sel, shared, kernel, interpret, cands = _choose_attention(
        workload.attention, dtype, device, distort,
        probes.probe_rng(*backend, "attention", repr(workload.attention)))
    if not sel.verified:
        problems.append("attention: no query chunking gives position-invariant rows")
    table += table_rows("attention", {}, cands, sel)
    attention = AttentionPlan(tuple((t, (c.desc["chunk"], c.desc["padded"]))
                                    for t, c in sorted(sel.choice.items())), shared, kernel,
                              interpret and kernel != "xla")
    uses_path = any(f.path for p in products for _, f in p.by_rows)
    plan = InvariancePlan(tuple(products), tuple(row_sums), attention,
                          verified=not problems, problems=tuple(problems),
                          bf16_path=path if uses_path else "",
                          layer_copies=device.platform == "cpu")
    return plan, table


def _choose_attention(use: AttentionUse, dtype: Any, device: Any, distort: Distort | None,
                      rng: np.random.Generator
                      ) -> tuple[Selection, bool, str, bool, list[Candidate]]:
    """choice.choose_attention over the candidates of one attention probe, made lazily as
    it asks for them: the kernel invariant by construction is the native one on the CPU,
    the Pallas one on a GPU or TPU (or the one MULTISERVE_ATTENTION_KERNEL forces). Returns
    (the selection, shared keys, the kernel, whether a Pallas kernel is interpreted, every
    candidate probed, in the order probed)."""
    probe = probes.AttentionProbe(use, dtype, device, distort, rng)
    pallas = probes.pallas_attention_kernel(use, device)
    if pallas is not None:
        name, interpret = pallas
        first: Callable[[int], Candidate] | None = probe.pallas(name, interpret)
    else:
        name, interpret = "native", False
        first = probe.native if probes.native_attention_usable(use, dtype, device) else None
    sel, shared, kernel = choose_attention(use.sizes, QUERY_CHUNKS, first, probe.candidate,
                                           name)
    return sel, shared, kernel, interpret, list(probe.done.values())
