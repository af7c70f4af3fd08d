"""`multiserve bench --fleet` on a tiny model: the 4-engine fleet (configs/cpu-4.toml on the
suite's 4 virtual devices, ephemeral ports, one row bucket: what is checked is the
plumbing and the figures' consistency, not speed), 2 clients per port, then the same 8
clients on one engine: one wave of streams, and the sustained chat load (--duration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_args import bench_options
from tiny_model import save_tiny_model

from multiserve.bench.http_stream import generate_body

FLAGS = ["--output-len", "6", "--no-progress", "--max-total-tokens", "4096", "--token-paddings",
         "64", "--chunked-prefill-size", "64", "--clients-per-port", "2", "--bs-paddings", "8",
         "--max-running", "8"]


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
         ) -> tuple[dict, str]:
    from multiserve.bench.run import bench_main

    model = save_tiny_model(tmp_path / "tiny")
    assert bench_main(bench_options("--fleet", "--model", str(model), *FLAGS, *extra)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_generate_body() -> None:
    assert generate_body([1, 2], 5) == {
        "input_ids": [1, 2], "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}


def test_fleet_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res, text = _run(tmp_path, capsys)
    assert "fleet / one engine" in text and "4 engines, 2 each" in text
    assert res["mode"] == "fleet" and res["num_engines"] == 4 and res["num_clients"] == 8
    assert res["clients_per_port"] == 2
    assert res["device_groups"] == [[0], [1], [2], [3]]
    spread, one = res["fleet"], res["one_engine"]
    for run in (spread, one):
        assert run["output_tokens"] == 48 and run["exact_length"]
        assert run["finish_reasons"] == ["length"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["wall_s"]
        assert run["tokens_per_s"] > 0
    assert len(set(spread["clients"])) == 4 and len(set(one["clients"])) == 1
    assert all(spread["clients"].count(url) == 2 for url in set(spread["clients"]))
    assert all(s > 0 for s in spread["steps_per_engine"])  # every engine served its client
    assert one["steps_per_engine"][0] > 0 and not any(one["steps_per_engine"][1:])
    assert res["ratio"] == pytest.approx(spread["tokens_per_s"] / one["tokens_per_s"])
    assert res["outputs_identical"] is True  # greedy: same ids on any engine, any batch
    assert res["cache_miss_count"] == [0, 0, 0, 0] and res["targets"]["zero_recompiles_met"]


def test_fleet_bench_sustained_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res, text = _run(tmp_path, capsys, "--duration", "1")
    assert "8 closed-loop chat clients for 1 s per side" in text
    assert res["duration_s"] == 1.0 and res["num_clients"] == 8
    spread, one = res["fleet"], res["one_engine"]
    for run in (spread, one):
        assert run["requests"] >= 8  # every client finished at least one request
        assert run["output_tokens"] > 0 and run["wall_s"] >= 1.0
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        assert 0 < run["latency_p50_s"] <= run["latency_p99_s"] <= run["wall_s"]
    assert len(set(spread["clients"])) == 4 and set(one["clients"]) == {spread["clients"][0]}
    assert all(s > 0 for s in spread["steps_per_engine"])
    assert one["steps_per_engine"][0] > 0 and not any(one["steps_per_engine"][1:])
    # greedy and seeded requests alike: the same text on any engine, in any batch
    assert res["compared_requests"] >= 8 and res["outputs_identical"] is True
    assert res["cache_miss_count"] == [0, 0, 0, 0]


@pytest.mark.parametrize("argv, message", [
    (["--fleet", "--duration", "0"], "--duration must be > 0"),
    (["--duration", "5"], "--duration is the sustained load of --fleet")])
def test_duration_is_checked_before_anything_starts(argv: list[str], message: str) -> None:
    from multiserve.bench.run import bench_main

    with pytest.raises(SystemExit, match=message):
        bench_main(bench_options(*argv))
