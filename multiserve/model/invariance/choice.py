"""The choice among probed candidates: pure logic over probe results (which probe rows a
candidate computed, their hashes at each placement, its time), no device and no jax, so
every rule here is tested without running a kernel (tests/model/test_choice.py).

Products, grouped products, row sums (`select`): each candidate at the LARGEST size is a
possible reference (an anchor) if its own rows agree wherever they are placed. A candidate
belongs to an anchor's class if every probe row it computed equals the anchor's row
bitwise. For each anchor, every size the engine runs takes the fastest member able to hold
it (rows >= the size; `fastest`, with the TIE rule); the anchor whose plan costs least (the
sum, over sizes, of each member's time over the fastest candidate's) wins. The anchor is a
member of its own class, so padding every step to the largest size is always there as the
last resort; if no anchor's rows are position-invariant the primitive has no invariant plan
(`verified=False`): the fastest candidate per size, flagged.

Attention (`choose_attention`): an order of preference, not timing (probing every chunking
at every size would cost more than it tells): the platform's kernel invariant by
construction (the native CPU kernel, or a Pallas kernel on a GPU or TPU) where it runs and
every size's rows equal its own reference; else the first position-invariant XLA reference in
preference order (`attention_preference`; shared keys first) and, per size, the first
candidate in that order whose rows equal it.

The native kernel computes each row alone (its rows are the same bits at every size by
construction), so its work at m rows is a subset of its work at any r > m rows: a probe
that timed it slower at fewer rows measured noise, and every rule here reads the native
kernel's time at m rows as at most its time at any larger size of the same formulation
(`bounded_seconds`). Without it one noisy probe padded a 64-row product to 128 rows in every
step (docs/performance.md §44).

Every size of one plan is served by members of ONE anchor's class: two sizes never use
formulations whose rows differ from each other.

The bfloat16 instruction path (`choose_path`): the native bfloat16 product has several
(native.BF16_PATHS), each with bits of its own, so each path's candidates are a class of
their own. A plan runs ONE path in every product at every size: for each path the plan
is chosen with the other paths' native candidates left out (`of_path`), and the path whose
plans cost least over every product (the same relative cost as `select`'s: each size's
time over the fastest candidate's there, summed) is the plan's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("multiserve.calibration")

TIE = 1.15  # candidates within this factor of the fastest count as equally fast


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


@dataclass
class Selection:
    """One primitive's choice: for each needed size the candidate used, the anchor (None:
    no position-invariant reference, so `verified` is False and the choice is merely the
    fastest)."""

    choice: dict[int, Candidate]
    anchor: Candidate | None
    verified: bool


def bounded_seconds(cands: Sequence[Candidate]) -> dict[int, float]:
    """id(candidate) -> the time the rules read: its own, except that a native candidate
    reads at most the time of the same native formulation (same description but for the
    rows) at any larger size among `cands` (module docstring)."""
    out = {id(c): c.seconds for c in cands}
    families: dict[str, list[Candidate]] = {}
    for c in cands:
        if c.desc.get("kernel") == "native":
            same = repr(sorted((k, repr(v)) for k, v in c.desc.items() if k != "rows"))
            families.setdefault(same, []).append(c)
    for members in families.values():
        least = float("inf")
        for c in sorted(members, key=lambda c: -c.rows):
            least = min(least, c.seconds)
            out[id(c)] = least
    return out


def fastest(cands: list[Candidate], seconds: dict[int, float] | None = None) -> Candidate:
    """The fastest candidate; among those within TIE of it (timing noise), the one with
    the fewest rows (least padding), then the native kernel (a probe times a product
    alone, but in a program the native kernel reads its layer of the panel stack in place:
    no layer slice in the scanned decoder, and the layer matrices it runs at every size
    fuse into one product), then the plain kernel (it needs no transposed copy in the
    scanned decoder), then the fastest. `seconds`: the times to read (id -> seconds;
    default each candidate's own)."""
    t = seconds if seconds is not None else {id(c): c.seconds for c in cands}
    quickest = min(t[id(c)] for c in cands)
    return min((c for c in cands if t[id(c)] <= quickest * TIE),
               key=lambda c: (c.rows, c.desc.get("kernel") != "native",
                              c.desc.get("kernel") == "nt", t[id(c)]))


def select(candidates: list[Candidate], sizes: Sequence[int]) -> Selection:
    """The cheapest plan in which every needed size m is served by a member of one anchor's
    class holding at least m rows (module docstring)."""
    top = max(c.rows for c in candidates)
    t = bounded_seconds(candidates)
    quickest = {m: min(t[id(c)] for c in candidates if c.rows >= m) for m in sizes}
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
            choice[m] = fastest(able, t)
        else:
            cost = sum(t[id(choice[m])] / max(quickest[m], 1e-9) for m in sizes)
            if best is None or cost < best[0]:
                best = (cost, Selection(choice, anchor, True))
    if best is not None:
        return best[1]
    # nothing invariant: the fastest candidate per size, flagged
    return Selection({m: fastest([c for c in candidates if c.rows >= m], t) for m in sizes},
                     None, False)


def of_path(candidates: list[Candidate], path: str) -> list[Candidate]:
    """The candidates a plan of instruction path `path` may use: every XLA formulation and
    the native candidates of that path."""
    return [c for c in candidates
            if c.desc.get("kernel") != "native" or c.desc.get("path", "") == path]


def plan_cost(candidates: list[Candidate], sizes: Sequence[int], sel: Selection) -> float:
    """A selection's cost as `select` ranks anchors: each size's time over the fastest
    candidate's at that size (among all of `candidates`), summed over the sizes; times read
    as `bounded_seconds` reads them. `sel` chose among members of `candidates`."""
    t = bounded_seconds(candidates)
    return sum(t[id(sel.choice[m])] / max(min(t[id(c)] for c in candidates if c.rows >= m),
                                          1e-9) for m in sizes)


def choose_path(probed: Sequence[tuple[list[Candidate], Sequence[int]]],
                paths: Sequence[str]) -> tuple[str, dict[str, float]]:
    """The plan's instruction path among `paths` (module docstring) over every probed
    product (its candidates and the sizes it runs), and each path's cost. One path (or
    none: float32) needs no timing."""
    if len(paths) <= 1:
        return (paths[0] if paths else ""), {}
    costs = {p: sum(plan_cost(cands, sizes, select(of_path(cands, p), sizes))
                    for cands, sizes in probed) for p in paths}
    return min(paths, key=lambda p: costs[p]), costs


def attention_preference(tokens: int, top: int, chunks: Sequence[int]
                         ) -> list[tuple[int, int]]:
    """(chunk, padded) candidates for a T-token step among the query chunk sizes `chunks`,
    best first: no padding beyond a multiple of the chunk, then the largest chunk (fewest
    iterations); then chunks larger than T (T padded up to the chunk), smallest first."""
    fits = [(c, -(-tokens // c) * c) for c in sorted(chunks, reverse=True) if c <= tokens]
    fits.sort(key=lambda cp: (cp[1], -cp[0]))
    larger = [(c, c) for c in sorted(chunks) if c > tokens and c <= max(top, 1)]
    return fits + larger


def choose_attention(sizes: Sequence[int], chunks: Sequence[int],
                     native: Callable[[int], Candidate] | None,
                     xla: Callable[[int, int, int, bool], Candidate],
                     native_kernel: str = "native") -> tuple[Selection, bool, str]:
    """The attention plan (module docstring) over candidates made on demand, in the order
    asked: `native(T)` the platform's kernel invariant by construction at T tokens, named
    `native_kernel` ("native" on the CPU, "pallas_gpu" / "pallas_tpu"; None: none runs
    here), `xla(T, chunk, padded, shared)` the XLA formulation. That kernel wins if its
    rows at the largest size are position-invariant and every size's rows equal them. Else the first
    position-invariant XLA reference in preference order at the largest size; then, for
    every size, the first candidate in preference order whose rows equal the reference's;
    none: the reference itself, the step padded to the largest size (last resort).
    Returns (the selection, shared keys, the kernel: `native_kernel` or "xla")."""
    top = max(sizes)
    if native is not None:
        anchor = native(top)
        ref = anchor.runs[0]
        if anchor.agrees(ref):
            choice = {t: native(t) for t in sizes}
            if all(c.agrees(ref) for c in choice.values()):
                return Selection(choice, anchor, True), False, native_kernel
        log.warning("the %s attention kernel's rows are not invariant on this backend; "
                    "using the XLA formulation", native_kernel)
    for chunk, padded in attention_preference(top, top, chunks):
        for shared in ((True, False) if chunk > 1 else (False,)):
            anchor = xla(top, chunk, padded, shared)
            ref = anchor.runs[0]
            if not anchor.agrees(ref):
                continue
            choice = {}
            for t in sizes:
                prefs = (xla(t, c, p, shared and c > 1)
                         for c, p in attention_preference(t, top, chunks))
                choice[t] = next((cand for cand in prefs if cand.agrees(ref)), anchor)
            return Selection(choice, anchor, True), shared, "xla"
    first = xla(top, *attention_preference(top, top, chunks)[0], False)
    return Selection({t: first for t in sizes}, None, False), False, "xla"


def table_rows(primitive: str, what: dict[str, Any], candidates: list[Candidate],
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
