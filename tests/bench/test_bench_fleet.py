"""`multiserve bench --fleet` on a tiny model: the 4-engine fleet (configs/cpu-4.toml on the
suite's 4 virtual devices, ephemeral ports), one streaming client per port, then the same
4 requests on one engine. Checks the plumbing and the figures' consistency, not speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_model import save_tiny_model

from multiserve.bench.http_stream import generate_body
from multiserve.cli import build_parser


def test_generate_body() -> None:
    assert generate_body([1, 2], 5) == {
        "input_ids": [1, 2], "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}


def test_fleet_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multiserve.bench.run import bench_main

    model = save_tiny_model(tmp_path / "tiny")
    args = build_parser().parse_args(
        ["bench", "--fleet", "--model", str(model), "--output-len", "6", "--no-progress",
         "--max-total-tokens", "4096", "--token-paddings", "64", "--chunked-prefill-size",
         "64", "--clients-per-port", "2"])
    assert bench_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
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
