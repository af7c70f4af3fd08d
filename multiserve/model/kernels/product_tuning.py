"""How the native products use this machine, measured on it: when a one-row product is
split over the intra-op pool's threads, and how far ahead a one-block product prefetches
its weight stream (src/product_split.h `ProductTuning`). Neither changes a bit of any
result (which thread reads which panel, and what is prefetched); both change how fast a
decode step's products read their weights, and the best values differ between CPUs: on an
AMD EPYC (Zen 5) one core alone reads at ~90% of the machine's bandwidth, on an Intel Xeon
(family 6, model 167) at about half of it (docs/performance.md §32).

`measure` times one-row bfloat16 products of a stack of layers (a decode step's pattern:
each layer's matrix read once, in turn) split and not split, at sizes from a few panels to
a few MB, and then at the largest size each prefetch distance of `AHEAD_BYTES`; the
threshold is the one with which the sizes take the least time together (each size at or
above it split), unless never splitting is faster (`choose_split`).
Every program is compiled and run once before any is timed, the pool's threads are kept busy
for WARM_SECONDS, and each time kept is a case's best over ROUNDS rounds that each visit
every case (`best_times`): on a 2-vCPU VM a fresh process's first split timings often found
the second core slow to join, which a measurement timing each case's rounds back to back
turned into "never split" (a one-row bf16 stream ~15% slower on a Zen 5 EPYC,
docs/performance.md §37).
The result is cached per kernel build (the build's name hashes the CPU) next to the
kernels, measured once per machine under a lock, and set in the kernels once per process
before an engine's calibration (`ensure`), whose plan key names it (store.backend_key).
A measurement is kept only if the machine was otherwise quiet while it ran: when other
processes used more than `BUSY_SHARE` of the machine's CPU meanwhile (/proc/stat's busy
time less this process's own), its times say how the machine was shared, not how it
reads (on 2 cores, a test suite running beside it chose a 4x later split and made one
stream ~25% slower); this process then runs the kernels' defaults and a process
`RETRY_SECONDS` later measures again.
MULTISERVE_PRODUCT_TUNING="split_units=N,ahead_bytes=M" sets it instead (A/B runs, tests).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

log = logging.getLogger("multiserve.native_kernels")

TUNING_ENV = "MULTISERVE_PRODUCT_TUNING"
TUNING_VERSION = 3  # bump when `measure` changes: cached measurements are then redone
PANELS = (1, 2, 4, 8, 16, 32)  # panels of 64 columns of the products timed for the split
K = 1024  # their contraction (512 k-pairs: a panel is 512 work units, 128 KB of bfloat16)
STACK_BYTES = 32 << 20  # each size's layer stack: larger than any core's L2
AHEAD_BYTES = (0, 1024, 2048, 4096, 8192)  # prefetch distances timed
# the margin a measured difference must have: a prefetch over none, never splitting over the
# split chosen
GAIN = 1.03
WARM_SECONDS = 1.0  # the pool's threads kept busy before the timings
ROUNDS = 7  # rounds of every case compared (best of), each round over all of them
BUSY_SHARE = 0.10  # others' CPU over a measurement, of the machine's, above which it is dropped
RETRY_SECONDS = 600  # after a dropped measurement, the defaults until then


@dataclass(frozen=True)
class ProductTuning:
    split_units: int = 1 << 12  # product_split.h's defaults
    ahead_bytes: int = 0
    # "measured", "environment", "default", or "busy" (the defaults: the measurement was
    # dropped, the machine being busy)
    source: str = "default"
    # what the measurement saw: seconds per product, per panel count and setting
    seconds: dict[str, float] | None = None

    def key(self) -> dict[str, int]:
        """What the plan's cache key records (the values, not how they were obtained)."""
        return {"split_units": self.split_units, "ahead_bytes": self.ahead_bytes}


_LOCK = threading.RLock()
_SET: list[ProductTuning] = []  # the tuning set in this process's kernels (once)
_MEASURING: list[bool] = []  # set while this process measures (its products re-enter)


def parse(text: str) -> ProductTuning:
    """MULTISERVE_PRODUCT_TUNING's value ("split_units=4096,ahead_bytes=0"; either may be
    left out) -> the tuning; a malformed value raises ValueError."""
    values = {"split_units": 1 << 12, "ahead_bytes": 0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in values or not value.strip().isdigit():
            raise ValueError(f"{TUNING_ENV}={text!r}: expected split_units=N,ahead_bytes=M "
                             "(non-negative integers)")
        values[name] = int(value)
    return ProductTuning(values["split_units"], values["ahead_bytes"], "environment")


def current() -> ProductTuning | None:
    """The tuning set in this process's kernels, or None before `ensure` ran."""
    return _SET[0] if _SET else None


def ensure(lib: ctypes.CDLL, cache_file: Any, measure_fn: Any) -> ProductTuning:
    """Set the machine's tuning in the loaded kernels `lib` once per process: the
    environment's, else the cached measurement (`cache_file`, a Path), else `measure_fn()`
    now (then cached). Returns it."""
    with _LOCK:
        if _SET:
            return _SET[0]
        if _MEASURING:  # the measurement's own products: the kernels' defaults meanwhile
            return ProductTuning()
        forced = os.environ.get(TUNING_ENV)
        if forced:
            tuning = parse(forced)
        else:
            _MEASURING.append(True)
            try:
                tuning = _cached_or_measured(cache_file, measure_fn)
            finally:
                _MEASURING.clear()
        lib.MultiserveSetProductTuning(ctypes.c_int64(tuning.split_units),
                                       ctypes.c_int64(tuning.ahead_bytes))
        _SET.append(tuning)
        log.info("native products: split from %d work units, prefetch %d bytes ahead (%s)",
                 tuning.split_units, tuning.ahead_bytes, tuning.source)
        return tuning


def _cached_or_measured(cache_file: Any, measure_fn: Any) -> ProductTuning:
    from multiserve.cache_files import exclusive

    def read() -> ProductTuning | None:
        try:
            d = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            return None
        if d.get("version") != TUNING_VERSION:
            return None
        return ProductTuning(int(d["split_units"]), int(d["ahead_bytes"]), "measured",
                             d.get("seconds"))

    found = read()
    if found is not None:
        return found
    busy_mark = cache_file.with_suffix(".busy")
    with exclusive(cache_file.with_suffix(".lock")):  # one process measures; others read
        found = read()
        if found is not None:
            return found
        try:
            if time.time() - busy_mark.stat().st_mtime < RETRY_SECONDS:
                return ProductTuning(source="busy")
        except OSError:
            pass
        tuning, others = _measured_alone(measure_fn)
        if others > BUSY_SHARE:
            busy_mark.write_text(f"{others:.3f}\n")
            log.warning("native products: other processes used %.0f%% of the CPU while "
                        "the split and prefetch were measured; the kernels' defaults "
                        "here, measured again by a process after %d s", 100 * others,
                        RETRY_SECONDS)
            return ProductTuning(source="busy")
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": TUNING_VERSION, **asdict(tuning),
                                   "others_cpu_share": round(others, 4)}, indent=1))
        tmp.replace(cache_file)
        return tuning


def machine_busy_seconds() -> float | None:
    """CPU-seconds every process has run on this machine since boot, steal included
    (/proc/stat's first line); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:9]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


_clock = time.monotonic  # the measurement's wall clock (a test's fabricated one)


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measured_alone(measure_fn: Any) -> tuple[ProductTuning, float]:
    """`measure_fn()` and the share of the machine's CPU other processes used while it
    ran (0.0 where the machine's busy time cannot be read)."""
    busy0, own0, t0 = machine_busy_seconds(), _own_seconds(), _clock()
    tuning = measure_fn()
    busy1, own1, wall = machine_busy_seconds(), _own_seconds(), _clock() - t0
    if busy0 is None or busy1 is None or wall <= 0:
        return tuning, 0.0
    others = max(0.0, (busy1 - busy0) - (own1 - own0))
    return tuning, others / (wall * (os.cpu_count() or 1))


def choose_split(times: dict[int, tuple[float, float]]) -> int:
    """The split threshold in work units from {work units: (seconds alone, seconds split)}:
    the threshold under which the sizes measured take the least time together (each size
    below it alone, each at or above it split; equal totals: the larger threshold), unless
    never splitting is faster than that by GAIN (then beyond the largest size measured).
    A total, not a win at every size, and "unless splitting loses", not "if it wins":
    where two threads read ~10% faster than one (a VM's two vCPUs on one memory, §37),
    timings within noise of a tie must not turn the split off; on that machine an engine
    whose products never split streamed one row 10-20% slower than one splitting from
    1024-4096 units, every paired run."""
    sizes = sorted(times)
    never = 2 * sizes[-1]

    def total(threshold: int) -> float:
        return sum(times[u][1] if u >= threshold else times[u][0] for u in sizes)

    best = min(sizes, key=lambda t: (total(t), -t))
    return never if total(never) * GAIN < total(best) else best


def choose_ahead(times: dict[int, float]) -> int:
    """The prefetch distance from {bytes: seconds}: the fastest, if it beats no prefetch
    by GAIN; else 0."""
    best = min(times, key=lambda b: times[b])
    return best if times[best] * GAIN <= times[0] else 0


def best_times(cases: list[tuple[Any, tuple[int, int]]], apply: Any,
               rounds: int) -> list[float]:
    """Each (timer, setting) case's best time over `rounds` rounds, `apply(setting)`
    before each timing; a round times every case once, in order, so a case's timings are
    spread over the whole measurement: a slowdown of the machine that lasts less than
    `rounds - 1` rounds leaves every case one unslowed timing."""
    best = [float("inf")] * len(cases)
    for _ in range(rounds):
        for i, (timer, setting) in enumerate(cases):
            apply(setting)
            best[i] = min(best[i], timer())
    return best


def measure(lib: ctypes.CDLL, pack: Any, product: Any) -> ProductTuning:
    """Time one-row products of layer stacks (module docstring) on this machine: `lib` the
    loaded kernels (it sets their tuning for each setting timed), `pack` and `product`
    native.py's pack_panels and row_gemm."""
    import jax
    import jax.numpy as jnp

    t0 = time.monotonic()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)

    def stack(panels: int) -> jax.Array:
        layer_bytes = K * panels * 64 * 2
        layers = max(2, STACK_BYTES // layer_bytes)
        w = rng.standard_normal((panels * 64, K)).astype(np.float32).T / np.sqrt(K)
        one = pack(jnp.asarray(w, jnp.bfloat16))
        return jnp.broadcast_to(one, (layers, *one.shape)) + jnp.zeros((), jnp.bfloat16)

    def per_product(panels_stack: jax.Array) -> Any:
        n = panels_stack.shape[1] * 64

        @jax.jit
        def run(a: jax.Array, p: jax.Array) -> jax.Array:
            def body(i: Any, acc: jax.Array) -> jax.Array:
                return acc + product(a, p, n, i, out_dtype=jnp.float32)[0, 0]
            return jax.lax.fori_loop(0, p.shape[0], body, jnp.zeros((), jnp.float32))

        def seconds() -> float:
            t = time.perf_counter()
            jax.block_until_ready(run(x, panels_stack))
            return (time.perf_counter() - t) / panels_stack.shape[0]

        seconds()  # compile and warm
        return seconds

    def apply(setting: tuple[int, int]) -> None:
        lib.MultiserveSetProductTuning(ctypes.c_int64(setting[0]), ctypes.c_int64(setting[1]))

    def best_of(cases: list[tuple[Any, tuple[int, int]]]) -> list[float]:
        return best_times(cases, apply, ROUNDS)

    # every size's program compiled and run once before any is timed; then the largest
    # split over the pool for WARM_SECONDS, so that the pool's threads are awake and their
    # cores in use when the timings begin (a VM's idle vCPU can be slow to wake: §37)
    timers = {panels: per_product(stack(panels)) for panels in PANELS}
    apply((0, 0))
    warm_until = time.monotonic() + WARM_SECONDS
    while time.monotonic() < warm_until:
        timers[PANELS[-1]]()
    # sizes inner: no case is timed right after another on the same stack (whose lines
    # the cache still held would favour the second)
    settings = ((1 << 62, 0), (0, 0))  # alone, split
    times = best_of([(timers[p], s) for s in settings for p in PANELS])
    seen: dict[str, float] = {}
    split_times: dict[int, tuple[float, float]] = {}
    for j, panels in enumerate(PANELS):
        alone, split = times[j], times[len(PANELS) + j]
        split_times[panels * (K // 2)] = (alone, split)
        seen[f"{panels}p alone"], seen[f"{panels}p split"] = alone, split
    split_units = choose_split(split_times)
    largest = PANELS[-1]  # the prefetch is timed at the largest size, split as chosen
    split_at = split_units if largest * (K // 2) >= split_units else 1 << 62
    ahead = best_of([(timers[largest], (split_at, a)) for a in AHEAD_BYTES])
    for a, t in zip(AHEAD_BYTES, ahead, strict=True):
        seen[f"{largest}p ahead {a}"] = t
    ahead_bytes = choose_ahead(dict(zip(AHEAD_BYTES, ahead, strict=True)))
    log.info("measured the native products' split and prefetch in %.1f s",
             time.monotonic() - t0)
    return ProductTuning(split_units, ahead_bytes, "measured", seen)
