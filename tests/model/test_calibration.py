"""The calibration (model/invariance/calibration.py) on an alien backend: the probe is made to see
candidates that sum differently (their rows' hashes changed), and must then choose the
fallback formulations, and say so in its table; the cache serves a second start."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from model_helpers import TINY_LLAMA

from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.choice import Candidate, select
from multiserve.model.invariance.workload import workload_for
from multiserve.model.invariance.plan import InvariancePlan

TOKENS = (1, 2, 4, 8, 16, 32, 64)
ROWS = (1, 2, 4, 8)


def _workload(tokens: tuple[int, ...] = TOKENS, rows: tuple[int, ...] = ROWS):
    return workload_for(TINY_LLAMA, tokens, rows, 8, 16, 16, np.float32, engine_defaults=False)


def alien(primitive: str, c: dict) -> bool:
    """A backend whose products below 16 rows (the GEMV included) each sum in their own
    order, whose 1- and 2-row attention chunks are other kernels, and whose row sums
    differ below 8 rows."""
    if primitive == "product":
        return c["rows"] < 16
    if primitive == "attention":
        return c["chunk"] <= 2
    return c["rows"] < 8


def alien_plan() -> InvariancePlan:
    return calibrate(_workload(), jax.devices()[0], distort=alien).plan


def test_alien_backend_gets_the_fallback_plan() -> None:
    plan = alien_plan()
    assert plan.verified
    for p in plan.products:
        for m, form in p.by_rows:
            if form.rows < max(TOKENS if p.name != "head" else ROWS):
                assert form.rows >= max(16, m), (p.name, m, form)
    assert all(chunk > 2 for _, (chunk, _) in plan.attention.by_tokens)
    assert all(padded >= 8 for rs in plan.row_sums for _, padded in rs.by_rows)


def test_only_padding_works_pads_every_step_to_the_largest() -> None:
    """Every candidate below the largest size differs: the last resort, every step padded
    to the reference's shape, is what remains (and it is still verified)."""
    # three step sizes and two logits row counts: every size below the largest still fails (the
    # full size ladder of the other tests only multiplies the failing probes)
    tokens, rows = (1, 4, 16), (1, 8)  # 8: the workload's max running requests
    top = max(tokens)
    plan = calibrate(_workload(tokens, rows), jax.devices()[0],
                     distort=lambda prim, c: (c.get("tokens", c.get("rows")) or 0) < top).plan
    assert plan.verified
    for p in plan.products:
        want = max(rows if p.name == "head" else tokens)
        assert {form.rows for _, form in p.by_rows} == {want}, p


def test_no_position_invariant_reference_is_not_verified() -> None:
    """A backend where no candidate's rows stay the same at other positions: the plan
    says it is not verified, and why."""
    def c(rows: int, runs: list[dict[int, int]]) -> Candidate:
        return Candidate({"kernel": "nt", "rows": rows}, rows, runs, 1.0)

    # the largest candidate gives row 0 other bits in its second placement
    cands = [c(1, [{0: 1}]), c(2, [{0: 1, 1: 1}, {0: 2, 1: 1}])]
    sel = select(cands, [1, 2])
    assert not sel.verified and sel.anchor is None


def test_second_start_reads_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiserve.model.invariance.calibration as cal

    monkeypatch.setenv("MULTISERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "_MEMO", {})
    wl = workload_for(TINY_LLAMA, (1, 4), (1,), 1, 16, 16, np.float32, engine_defaults=False)
    first = calibrate(wl, jax.devices()[0])
    assert not first.cached and first.probe_seconds > 0
    assert list((tmp_path / "invariance").glob("*.json"))
    monkeypatch.setattr(cal, "_MEMO", {})
    second = calibrate(wl, jax.devices()[0])
    assert second.cached and second.plan == first.plan and second.key_hash == first.key_hash
    assert second.key["jax"] == jax.__version__ and "workload" in second.key


def test_products_probed_once_per_process_across_workloads(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path) -> None:
    """Two workloads of one model that differ only in their KV page size (two engines with
    other pages, or two tests): the second probes its attention but not the products the
    first probed already, and its product plans are the first's; nor does another process
    (the probes are stored). A distorted or uncached calibration never reuses a probe."""
    import multiserve.model.invariance.calibration as cal
    from multiserve.model.invariance import probes

    monkeypatch.setenv("MULTISERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "_MEMO", {})
    monkeypatch.setattr(cal, "_PROBES", {})
    calls: list[str] = []
    real = probes.probe_product

    def counting(use, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(use.name)
        return real(use, *args, **kw)

    monkeypatch.setattr(probes, "probe_product", counting)
    first = calibrate(workload_for(TINY_LLAMA, (1, 4), (1,), 1, 16, 16, np.float32,
                                   engine_defaults=False),
                      jax.devices()[0])
    probed = len(calls)
    assert probed > 0
    second = calibrate(workload_for(TINY_LLAMA, (1, 4), (1,), 1, 8, 16, np.float32,
                                    engine_defaults=False), jax.devices()[0])
    assert len(calls) == probed and second.key_hash != first.key_hash
    assert second.plan.products == first.plan.products
    calibrate(workload_for(TINY_LLAMA, (1, 4), (1,), 1, 4, 16, np.float32,
                           engine_defaults=False), jax.devices()[0], use_cache=False)
    assert len(calls) == 2 * probed  # probed again, each distinct shape once
    # another process (empty memos, the same cache folder) reads the stored probes
    monkeypatch.setattr(cal, "_MEMO", {})
    monkeypatch.setattr(cal, "_PROBES", {})
    third = calibrate(workload_for(TINY_LLAMA, (1, 4), (1,), 1, 4, 16, np.float32,
                                   engine_defaults=False), jax.devices()[0])
    assert len(calls) == 2 * probed and not third.cached
    assert third.plan.products == first.plan.products


def test_probe_timing_takes_the_candidates_in_turns() -> None:
    """A probe's candidates are timed in rounds, each once per round (a slow period of the
    machine falls on all of them alike), and each gets its own best time."""
    import itertools

    from multiserve.model.invariance import probes

    calls: list[int] = []

    def fn(i: int) -> int:
        calls.append(i)
        return i

    seconds = probes.timed([lambda i=i: fn(i) for i in range(3)])
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    # after one warm-up call each, consecutive calls of one fn are one mean
    rounds = [i for i, _ in itertools.groupby(calls[3:])]
    assert rounds == [0, 1, 2] * probes.TIMING_RUNS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probes_compile_with_the_step_programs_options(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration verifies the machine code the steps run: every probe (products, row
    sums, attention) is compiled with the step programs' XLA options for the MODEL's dtype
    (xla_options.step_options; row sums of float32 rows too), and those options reach XLA:
    one it refuses fails the calibration instead of being dropped."""
    import multiserve.model.invariance.calibration as cal
    from multiserve.model.invariance import probes
    from multiserve.model.invariance.xla_options import step_options

    monkeypatch.setattr(cal, "_MEMO", {})
    monkeypatch.setattr(cal, "_PROBES", {})
    asked: list[tuple[str, str]] = []
    compiled: list[str] = []
    real_jit = probes.probe_jit

    def recording(platform: str, name: str) -> dict[str, bool | int]:
        asked.append((platform, name))
        return step_options(platform, name)

    def tracing(fn, dtype, device):  # noqa: ANN001, ANN202
        compiled.append(getattr(fn, "__name__", ""))
        return real_jit(fn, dtype, device)

    monkeypatch.setattr(probes, "step_options", recording)
    monkeypatch.setattr(probes, "probe_jit", tracing)
    device = jax.devices()[0]
    workload = workload_for(TINY_LLAMA, (1, 4), (1,), 1, 16, 16, jax.numpy.dtype(dtype),
                            engine_defaults=False)
    calibrate(workload, device, use_cache=False)
    assert set(asked) == {(device.platform, dtype)}
    assert len(asked) == len(compiled)
    assert {"<lambda>", "attend_rows"} <= set(compiled)  # products, row sums; attention

    monkeypatch.setattr(cal, "_MEMO", {})
    monkeypatch.setattr(probes, "step_options",
                        lambda platform, name: {"xla_no_such_option_in_this_test": True})
    with pytest.raises(Exception, match="No such compile option"):
        calibrate(workload, device, use_cache=False)
