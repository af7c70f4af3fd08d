"""The chaos run's greedy check: answers against an undisturbed reference.

Owns `check_against_reference(fleet, operator, outcomes, report)`. A greedy request is
comparable when it completed or was aborted and its lifetime overlaps no weight-change
window (so its weight version is known: the fleet's version after the last window that
ended before it started). For each version and each distinct (api, prompt, max_tokens,
stop), one undisturbed non-streaming request is sent with the fleet set to that version
(the references of a version run concurrently, REFERENCES_IN_FLIGHT at a time over every
engine: greedy answers are batch- and engine-invariant, which this also checks); every
choice of every comparable request must equal it (text; token ids
too for the native API), and an aborted native choice must be a prefix of its ids.
Afterwards the fleet is left on the base weights.

Invariant: runs on an idle fleet (after the chaos phase); loopback only.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx

from multiserve.reliability.chaos_ops import BASE_VERSION, Operator
from multiserve.reliability.chaos_workload import Outcome, Spec, send

REFERENCES_IN_FLIGHT = 16


def _version_at(op: Operator, t: float) -> str:
    """The fleet's version at time t outside every weight window (windows alternate)."""
    version = BASE_VERSION
    for (_, end), rec in zip(op.weight_windows, _weight_results(op), strict=False):
        if end <= t and rec is not None:
            version = rec
    return version


def _weight_results(op: Operator) -> list[str | None]:
    """Per weight window, the version it switched to (None: the update failed)."""
    out: list[str | None] = []
    for r in op.records:
        if r.name.startswith("update_weights->"):
            out.append(r.name.split("->", 1)[1] if r.ok else None)
    return out


def comparable(o: Outcome, op: Operator) -> bool:
    """Whether `o` is checked against the reference: greedy, completed or aborted, and
    outside every weight-change window."""
    if not o.spec.greedy or o.kind not in ("completed", "aborted"):
        return False
    return not any(s < o.ended and o.started < e for s, e in op.weight_windows)


async def check_against_reference(fleet: Any, op: Operator, outcomes: list[Outcome],
                                  report: Any, checkpoints: dict[str, str]) -> None:
    """Fill report.compared / mismatches / problems (see the module docstring)."""
    model = fleet.workers[0].model_name
    groups: dict[str, dict[tuple[Any, ...], list[Outcome]]] = {}
    for o in outcomes:
        if comparable(o, op):
            groups.setdefault(_version_at(op, o.started), {}).setdefault(o.spec.key, []).append(o)
    gate = asyncio.Semaphore(REFERENCES_IN_FLIGHT)
    async with httpx.AsyncClient() as http:
        for version in sorted(groups, key=lambda v: v != BASE_VERSION):
            r = await http.post(f"{fleet.supervisor_url}/update_weights_from_disk", timeout=300,
                                json={"path": checkpoints[version], "weight_version": version})
            if r.status_code != 200:
                report.problems.append(f"reference: cannot set weights {version}: {r.text}")
                continue
            urls = itertools.cycle(fleet.urls)

            async def reference(i: int, s0: Spec, url: str, version: str = version) -> Outcome:
                spec = Spec(f"ref-{version}-{i}", s0.kind, s0.prompt, s0.max_tokens, False,
                            True, None, 1, s0.stop, None)
                async with gate:
                    return await send(http, url, model, spec, 120.0)

            keyed = list(groups[version].items())
            refs = await asyncio.gather(*(reference(i, group[0].spec, next(urls))
                                          for i, (_, group) in enumerate(keyed)))
            for (key, group), ref in zip(keyed, refs, strict=True):
                if ref.kind != "completed":
                    report.problems.append(f"reference {key}: {ref.kind} {ref.error}")
                    continue
                for o in group:
                    report.compared += 1
                    _compare(o, ref, version, report)
        if BASE_VERSION not in groups or len(groups) > 1:  # leave the base weights on
            await http.post(f"{fleet.supervisor_url}/update_weights_from_disk", timeout=300,
                            json={"path": checkpoints[BASE_VERSION],
                                  "weight_version": BASE_VERSION})


def _compare(o: Outcome, ref: Outcome, version: str, report: Any) -> None:
    want_text, want_ids = ref.texts.get(0, ""), ref.ids.get(0)
    for i in range(o.spec.n):
        text, ids = o.texts.get(i, ""), o.ids.get(i)
        if o.finish.get(i) == "abort":
            if ids is not None and want_ids is not None and ids != want_ids[:len(ids)]:
                report.mismatches.append(f"{o.spec.rid}#{i} ({version}) aborted output is not "
                                         f"a prefix of the reference: {ids} vs {want_ids}")
            continue
        if text != want_text or (ids is not None and ids != want_ids):
            report.mismatches.append(f"{o.spec.rid}#{i} ({version}, {o.spec.kind}, stream="
                                     f"{o.spec.stream}): {text!r} != reference {want_text!r}")
