"""`multiserve bench --lora-adapters N --lora-rank R` on a tiny model: the base model alone
and the same requests with N random adapters, their runs alternated in one invocation,
batch and single stream. Checks the plumbing and the figures' consistency (the ratio is
LoRA / base of the two sides' tok/s), not speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bench_args import bench_options
from tiny_model import TINY, save_tiny_model

SMALL = ["--no-progress", "--token-paddings", "64", "--bs-paddings", "8",
         "--max-running", "8", "--max-total-tokens", "4096", "--chunked-prefill-size", "64"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict, str]:
    from multiserve.bench.run import bench_main

    assert bench_main(bench_options(*argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_lora_batch_runs_base_then_adapters(tiny: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    res, text = _run(capsys, "--model", str(tiny), "--num-prompts", "6", "--output-len", "5",
                     "--rounds", "2", "--lora-adapters", "3", "--lora-rank", "4", *SMALL)
    assert res["mode"] == "lora_batch"
    assert res["lora"].pop("kernel") in ("native", "xla")
    assert res["lora"] == {"adapters": 3, "rank": 4, "lora_alpha": 4.0,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"]}
    for side in ("base", "with_lora"):
        run = res[side]
        assert run["runs"] == 2 and run["output_tokens"] == 60 and run["exact_length"]
        assert run["finish_reasons"] == ["length"] and run["tokens_per_s"] > 0
        assert run["outputs_identical"]  # greedy: each side's runs agree
        assert run["tokens_per_s"] == pytest.approx(60 / run["wall_s"])
    assert res["ratio_of_totals"] == pytest.approx(res["with_lora"]["tokens_per_s"]
                                                   / res["base"]["tokens_per_s"])
    pairs = [lo / b for lo, b in zip(res["with_lora"]["runs_tokens_per_s"],
                                     res["base"]["runs_tokens_per_s"], strict=True)]
    assert res["pair_ratios"] == pytest.approx(pairs)
    assert res["ratio"] == pytest.approx(float(np.median(pairs)))
    assert res["cache_miss_count"] == [0, 0] and res["targets"]["zero_recompiles_met"]
    assert "with 3 adapter(s)" in text and "rank 4 on q, k, v, o, gate, up, down" in text


def test_lora_single_stream(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res, _ = _run(capsys, "--model", str(tiny), "--single-stream", "--output-len", "4",
                  "--rounds", "2", "--lora-adapters", "1", *SMALL)
    assert res["mode"] == "lora_single_stream" and res["lora"]["rank"] == 16
    assert res["pairs"] == 2
    assert res["base"]["output_tokens"] == 8 and res["with_lora"]["output_tokens"] == 8
    assert res["base"]["outputs_identical"] and res["with_lora"]["outputs_identical"]
    assert res["targets"]["ratio"] == 0.9 and res["cache_miss_count"] == [0, 0]


def test_random_adapters_are_seeded_peft_tensors() -> None:
    from multiserve.bench.lora_bench import random_adapter_tensors
    from multiserve.config import ModelConfig
    from multiserve.engine.base.lora_adapters import adapter_from_tensors

    cfg = ModelConfig(**TINY)
    one, again = random_adapter_tensors(cfg, 4, 7), random_adapter_tensors(cfg, 4, 7)
    assert one.keys() == again.keys() and len(one) == 2 * 7 * cfg.num_layers
    assert all(np.array_equal(one[k], again[k]) for k in one)
    assert not np.array_equal(one[next(iter(one))], random_adapter_tensors(cfg, 4, 8)[
        next(iter(one))])
    adapter = adapter_from_tensors("x", one, r=4, lora_alpha=4.0, model_cfg=cfg, max_rank=8)
    assert adapter.rank == 4 and len(adapter.target_modules) == 7


@pytest.mark.parametrize("flag", [["--fleet"], ["--ab-overlap"], ["--lora-rank", "0"]])
def test_lora_refuses_what_it_does_not_compare(flag: list[str]) -> None:
    from multiserve.bench.run import bench_main

    with pytest.raises(SystemExit, match="lora"):
        bench_main(bench_options("--lora-adapters", "2", *flag))
