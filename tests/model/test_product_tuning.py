"""The native products' machine tuning (model/kernels/product_tuning.py): how the split
threshold and the prefetch distance are chosen from measured times (fabricated here: no
claim about which is faster on any machine), the environment's override, the cached
measurement, and that neither setting changes a bit of any product: products run in
processes with opposite settings (every product split or none, no prefetch or 8 KB
ahead) give the same bits, float32 and every bfloat16 path, at 1, 5 and 40 rows; and the
plan's key names the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from multiserve.model.kernels import product_tuning
from multiserve.model.kernels.product_tuning import (
    ProductTuning,
    best_times,
    choose_ahead,
    choose_split,
    parse,
)


def test_the_split_starts_where_the_sizes_take_the_least_time_together() -> None:
    # (alone, split) seconds per size in work units
    times = {512: (1.0, 1.5), 1024: (2.0, 1.5), 2048: (4.0, 4.5), 4096: (8.0, 5.0),
             8192: (16.0, 9.0)}
    # from 1024 or from 4096: 21.0 either way (2048's loss undoes 1024's win): the larger
    assert choose_split(times) == 4096
    assert choose_split({512: (1.0, 2.0), 1024: (2.0, 3.0)}) == 2048  # never: beyond
    assert choose_split({512: (2.0, 1.0), 1024: (4.0, 2.0)}) == 512  # always
    # splitting within GAIN of not splitting, in total: split (it does not lose)
    assert choose_split({512: (1.0, 1.0), 1024: (2.0, 2.05)}) == 1024  # 512 ties: larger
    assert choose_split({512: (1.0, 1.1), 1024: (2.0, 2.2)}) == 2048  # loses by 10%
    # a split ~10% faster from memory, one mid size a hair slower split: the larger sizes'
    # wins still start the split below it (a rule asking every larger size to win gave 8192)
    near = {512: (3.6, 3.6), 1024: (7.0, 7.3), 2048: (13.8, 13.4), 4096: (26.3, 26.4),
            8192: (53.8, 49.3), 16384: (106.0, 96.6)}
    assert choose_split(near) == 2048


def test_a_slowdown_shorter_than_the_rounds_changes_no_best_time() -> None:
    """The machine runs every timing at twice its time during a window of consecutive
    timings (the other core taken for a while): each case's best is still its unslowed
    time, since a round visits every case before the next round begins."""
    n_cases, rounds = 12, 7
    calls: list[tuple[int, int]] = []
    clean = [1.0 + i for i in range(n_cases)]

    def timer_for(i: int):  # noqa: ANN202
        def timer() -> float:
            slowed = 4 <= len(calls) < 4 + n_cases * (rounds - 2)  # 5 rounds' worth
            calls.append((i, len(calls)))
            return clean[i] * (2.0 if slowed else 1.0)
        return timer

    applied: list[tuple[int, int]] = []
    cases = [(timer_for(i), (i, 0)) for i in range(n_cases)]
    assert best_times(cases, applied.append, rounds) == clean
    assert len(calls) == n_cases * rounds
    # each timing ran under its own case's setting, set right before it
    assert applied == [(i, 0) for _ in range(rounds) for i in range(n_cases)]
    # no case is timed twice in a row (a case's second timing would find its stack in cache)
    assert all(a[0] != b[0] for a, b in zip(calls, calls[1:], strict=False))


def test_the_prefetch_is_the_fastest_distance_only_if_it_beats_none() -> None:
    assert choose_ahead({0: 1.0, 1024: 0.8, 4096: 0.9}) == 1024
    assert choose_ahead({0: 1.0, 1024: 0.99}) == 0


def test_the_environment_sets_the_tuning_and_a_bad_value_is_refused() -> None:
    assert parse("split_units=0,ahead_bytes=2048").key() == {"split_units": 0,
                                                            "ahead_bytes": 2048}
    assert parse("ahead_bytes=64") == ProductTuning(1 << 12, 64, "environment")
    for bad in ("split=3", "split_units=-1", "ahead_bytes=x"):
        with pytest.raises(ValueError, match="MULTISERVE_PRODUCT_TUNING"):
            parse(bad)


def test_a_measurement_is_cached_and_read_back(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the machine seen quiet: the suite's other workers must not make this measurement "busy"
    monkeypatch.setattr(product_tuning, "machine_busy_seconds", lambda: 0.0)
    calls = []

    def measure() -> ProductTuning:
        calls.append(1)
        return ProductTuning(2048, 1024, "measured", {"1p alone": 1e-5})

    path = tmp_path / "k.so.tuning.json"
    first = product_tuning._cached_or_measured(path, measure)
    second = product_tuning._cached_or_measured(path, measure)
    assert calls == [1] and first == second and first.key() == {"split_units": 2048,
                                                               "ahead_bytes": 1024}
    stale = json.loads(path.read_text())
    path.write_text(json.dumps({**stale, "version": -1}))  # another measurement's format
    product_tuning._cached_or_measured(path, measure)
    assert calls == [1, 1]



def test_a_measurement_made_while_others_ran_is_dropped_then_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes' CPU during the measurement (fabricated /proc/stat readings): the
    times are not kept, the process runs the defaults, and no process measures again
    until RETRY_SECONDS have passed; a quiet measurement then is kept."""
    others = {"busy": 100.0, "per_call": 0.0}
    calls = []

    def busy_seconds() -> float:  # each reading: the others' CPU since the last
        others["busy"] += others["per_call"]
        return others["busy"]

    def measure() -> ProductTuning:
        calls.append(1)
        return ProductTuning(16384, 0, "measured", {"1p alone": 1e-5})

    monkeypatch.setattr(product_tuning, "machine_busy_seconds", busy_seconds)
    # 10 s a measurement
    monkeypatch.setattr(product_tuning, "_clock", iter(range(0, 10**6, 10)).__next__)
    path = tmp_path / "k.so.tuning.json"
    others["per_call"] = 0.5 * 10 * (os.cpu_count() or 1)  # half the machine, 10 s
    got = product_tuning._cached_or_measured(path, measure)
    assert got == ProductTuning(source="busy") and not path.exists()
    assert product_tuning._cached_or_measured(path, measure).source == "busy"
    assert calls == [1]  # within RETRY_SECONDS: not measured again
    stale = path.with_suffix(".busy")
    old = stale.stat().st_mtime - product_tuning.RETRY_SECONDS - 1
    os.utime(stale, (old, old))
    others["per_call"] = 0.0
    got = product_tuning._cached_or_measured(path, measure)
    assert calls == [1, 1] and got.key() == {"split_units": 16384, "ahead_bytes": 0}
    assert json.loads(path.read_text())["others_cpu_share"] == 0.0


def test_the_machine_busy_time_reads_on_linux() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this system: a measurement is always kept")
    first = product_tuning.machine_busy_seconds()
    sum(i * i for i in range(300_000))  # this process's own CPU counts as busy
    second = product_tuning.machine_busy_seconds()
    assert first is not None and second is not None and second >= first > 0

_PRODUCTS = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from multiserve.model.kernels import native
assert native.unavailable_reason("bfloat16") is None
rng = np.random.default_rng(0)
out = {}
for k, n in ((576, 1536), (1601, 200)):
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    for dtype, paths in ((jnp.float32, (None,)),
                         (jnp.bfloat16, native.bf16_paths_available())):
        panels = native.pack_panels(jnp.asarray(w, dtype))
        for path in paths:
            for m in (1, 5, 40):
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                y = native.row_gemm(x, panels, n, out_dtype=jnp.float32, path=path)
                out[f"{k}-{dtype.__name__}-{path}-{m}"] = np.asarray(y)
np.savez(sys.argv[1], **out)
print(native.tuned().key())
"""


def test_no_setting_changes_a_bit_and_the_plan_key_names_it(tmp_path: Path) -> None:
    """Opposite settings in two processes: the same bits everywhere."""
    runs = []
    for i, setting in enumerate(("split_units=0,ahead_bytes=8192",
                                 "split_units=1000000000,ahead_bytes=0")):
        env = {**os.environ, product_tuning.TUNING_ENV: setting}
        out = tmp_path / f"run{i}.npz"
        done = subprocess.run([sys.executable, "-c", _PRODUCTS, str(out)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        last = done.stdout.strip().splitlines()[-1]
        assert last == repr(parse(setting).key())
        runs.append(np.load(out))
    assert runs[0].files == runs[1].files and len(runs[0].files) >= 12
    for name in runs[0].files:
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


def test_the_plan_key_names_this_process_tuning() -> None:
    import jax

    from multiserve.config import ModelConfig
    from multiserve.model.invariance import store
    from multiserve.model.invariance.workload import default_workload
    from multiserve.model.kernels import native

    if native.unavailable_reason() is not None:
        pytest.skip("no native kernels here: the key has no native part")
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64,
                      intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    key = store.backend_key(jax.devices()[0], default_workload(cfg))
    assert key["product_tuning"] == native.tuned().key()
