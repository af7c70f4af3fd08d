"""Chaos run, in-suite profile: the 4-engine tiny fleet on the CPU virtual devices, 16
concurrent clients over the 4 ports and the fleet's front door (chat, completions and
native; streaming and not; n > 1; seeds; stop strings; clients that leave mid-stream)
for CHAOS_SECONDS while random supervisor and per-engine operations fire (pauses in
every mode, vLLM's /pause in abort, wait and keep modes, aborts, flushes, staged weight
updates to a perturbed checkpoint and back, memory release/resume, an injected
fault and a restart). Then: one final outcome per request and none hung/lost/dropped,
greedy answers equal the reference for their weight version, every engine healthy and
KV-whole, no thread leak (RSS reported).

The suite's budget buys CHAOS_SECONDS of load here: at least that long, until every kind
of operation has fired once (the operator plays its first shuffled deck out: 15 kinds, ~8
s at one every ~0.5 s), with operations every ~0.5 s (~16 of them, so the second deck
starts under load too), and until MIN_COMPLETED requests completed, MIN_COMPARED of them
checkable against the reference: counts the run waits for, not a rate, so a slow or busy
machine runs longer instead of failing (a run once completed 14 requests in its 8 s with
the suite's three processes on a slow day). About 35 s of wall time with start-up,
warm-up and the reference run. Longer: `multiserve chaos --minutes 10` (README,
"Reliability runs").
"""

from __future__ import annotations

from collections import Counter

import pytest

CHAOS_SECONDS = 8.0
MIN_COMPLETED = 24
MIN_COMPARED = 12

pytestmark = pytest.mark.timeout(900)


def test_chaos_run_loses_nothing() -> None:
    from multiserve.reliability.chaos_run import ChaosConfig, run_chaos

    report = run_chaos(ChaosConfig(seconds=CHAOS_SECONDS, clients=16, seed=0, op_gap_s=0.5,
                                   min_completed=MIN_COMPLETED, min_comparable=MIN_COMPARED))
    print("\n".join(report.lines()))
    kinds = Counter(o.kind for o in report.outcomes)
    assert not report.violations, report.lines()
    assert not report.mismatches, report.mismatches[:5]
    assert not report.problems, report.problems
    assert not report.leaked_threads, report.new_threads
    assert report.ok, report.lines()
    assert kinds["completed"] >= MIN_COMPLETED and report.compared >= MIN_COMPARED, (
        kinds, report.compared, report.seconds)
    # every engine port and the front door had traffic
    assert len({o.port for o in report.outcomes}) == 5
    ops = {r.name for r in report.ops}
    for name in ("pause_abort", "pause_retract", "pause_in_place", "continue", "flush",
                 "vllm_pause_abort", "vllm_pause_wait", "vllm_pause_keep", "vllm_resume",
                 "update_weights->perturbed", "update_weights->default", "release_memory",
                 "resume_memory", "inject_fault", "restart_engine"):
        assert name in ops, (name, sorted(ops))
    assert {"abort_rid", "abort_all"} & ops
