"""Peer plumbing of `multiserve bench` without the peers' own environments (they are made by
scripts/peer-envs.sh and exercised by hand): which interpreter and environment a peer gets,
the subprocess protocol end to end with a fake peer script, the ours-vs-peer table, and
`--peer` / `--single-stream` on a tiny model with the peer replaced by a stub, greedy and
sampled (`--temperature`, `--seed`: the peer gets both, the agreement is null)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_args import bench_options
from shipped_engine import SHIPPED_FUSED_STEP_MAX
from tiny_model import ENGINE_FLAGS, save_tiny_model

from multiserve.bench import peer as peer_mod
from multiserve.bench.report import comparison_table, ratio, run_row
from multiserve.cli import build_parser

FAKE_PEER = '''
import sys
from plugins.peers.protocol import emit, load_prompts, parse_args, reserve_stdout
args = parse_args("fake peer")
out = reserve_stdout()
print("framework noise on stdout")  # must not reach the caller's stdout
prompts = load_prompts(args.prompts_file)
ids = [[7] * args.output_len for _ in prompts]
emit({"peer": "fake", "stream": args.stream, "model": args.model, "ids": ids,
      "batch_size": args.batch_size, "threads": args.threads,
      "temperature": args.temperature, "seed": args.seed}, out)
'''


def test_peer_python_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(peer_mod.ENVS_VAR, str(tmp_path))
    with pytest.raises(peer_mod.PeerError, match="scripts/peer-envs.sh vllm"):
        peer_mod.peer_python("vllm")
    assert peer_mod.peer_python("hf") == sys.executable  # hf falls back to multiserve's
    env_dir = tmp_path / "vllm"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("")
    (env_dir / "peer.env").write_text("LD_PRELOAD=/lib/a.so:/lib/b.so\n# comment\nFOO=1\n")
    assert peer_mod.peer_python("vllm") == str(env_dir / "bin" / "python")
    env = peer_mod.peer_environ("vllm", base={"PYTHONPATH": "/x", "FOO": "mine"})
    assert env["PYTHONPATH"].split(":")[:2] == [str(peer_mod.REPO_DIR), "/x"]
    assert env["LD_PRELOAD"] == "/lib/a.so:/lib/b.so"
    assert env["FOO"] == "mine"  # the caller's setting wins
    assert peer_mod.peer_script("vllm").name == "vllm_generate.py"
    assert peer_mod.peer_script("llamacpp").name == "llamacpp_generate.py"


def test_run_peer_protocol_with_a_fake_peer(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "hf_generate.py").write_text(FAKE_PEER)
    monkeypatch.setattr(peer_mod, "PLUGINS_DIR", plugins)
    monkeypatch.setenv(peer_mod.ENVS_VAR, str(tmp_path / "no-envs"))
    res = peer_mod.run_peer("hf", [[1, 2], [3]], 3, "/some/model", batch_size=1, threads=2,
                            stream=True, show_progress=False, temperature=0.7, seed=11)
    assert res == {"peer": "fake", "stream": True, "model": "/some/model",
                   "ids": [[7, 7, 7], [7, 7, 7]], "batch_size": 1, "threads": 2,
                   "temperature": 0.7, "seed": 11}
    res = peer_mod.run_peer("hf", [[1]], 1, "/m", show_progress=False)  # default: greedy
    assert res["temperature"] == 0.0 and res["seed"] == 0


def _figures(tps: float, ttft: float, itl: float) -> dict[str, Any]:
    return {"tokens_per_s": tps, "wall_s": 2.0, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
            "itl_p50_s": itl, "itl_p99_s": itl, "output_ids": [[1, 2, 3], [4, 5, 6]]}


def test_comparison_table() -> None:
    ours, peer = _figures(200.0, 0.1, 0.02), _figures(100.0, 0.2, float("nan"))
    lines = comparison_table(ours, peer, "vllm",
                             {"identical_fraction": 0.5, "mean_common_prefix": 2.5}, 2, 3)
    text = "\n".join(lines)
    assert "ours vs vllm" in lines[0] and "ours/peer" in lines[0]
    tps = next(ln for ln in lines if ln.startswith("tokens/s"))
    assert tps.split()[-3:] == ["200.0", "100.0", "2.00x"]
    ttft = next(ln for ln in lines if ln.startswith("TTFT p50"))
    assert ttft.split()[-3:] == ["100", "200", "0.50x"]
    itl = next(ln for ln in lines if ln.startswith("ITL p50"))
    assert itl.split()[-2:] == ["-", "-"]  # unknown figure, no ratio
    assert "identical: 50% of 2; mean common prefix 2.5 of 3 tokens" in text
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert math.isclose(ratio(3.0, 2.0) or 0, 1.5)
    assert run_row("x", peer).split()[-2:] == ["-", "-"]
    sampled = comparison_table(ours, peer, "vllm", None, 2, 3, note="temperature 1 > 0: no")
    assert sampled[-1] == "outputs not compared: temperature 1 > 0: no"
    assert not any("identical" in ln for ln in sampled)


def test_cli_flags() -> None:
    p = build_parser()
    a = p.parse_args(["bench", "--peer", "vllm", "--single-stream"])
    assert a.peer == "vllm" and a.single_stream and a.output_len is None
    a = p.parse_args(["bench", "--peer", "llamacpp", "--peer-model", "/m.gguf"])
    assert a.peer == "llamacpp" and a.peer_model == "/m.gguf"
    a = p.parse_args(["bench", "--fleet", "--config", "configs/cpu-4.toml"])
    assert a.fleet and a.config == "configs/cpu-4.toml"
    a = p.parse_args(["bench"])
    assert a.temperature == 0.0 and a.seed == 0 and not a.no_breakdown
    a = p.parse_args(["bench", "--temperature", "1", "--seed", "42", "--no-breakdown"])
    assert a.temperature == 1.0 and a.seed == 42 and a.no_breakdown
    assert a.interleave is None  # the peer decides: bench/run.py _interleaved
    assert p.parse_args(["bench", "--no-interleave"]).interleave is False


def test_bad_sampling_flags_fail_before_compiling() -> None:
    from multiserve.bench.run import bench_main

    with pytest.raises(SystemExit, match="temperature"):
        bench_main(bench_options("--temperature", "-1"))
    with pytest.raises(SystemExit, match="seed"):
        bench_main(bench_options("--temperature", "1", "--seed", str(2**63 - 2)))
    with pytest.raises(SystemExit, match="--fleet compares greedy"):
        bench_main(bench_options("--fleet", "--temperature", "1"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bench"))


@pytest.fixture
def stub_peer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the peer subprocess: the stub answers with fixed ids at 10 tok/s."""
    calls: list[dict[str, Any]] = []

    def fake_run_peer(name: str, prompts: Any, output_len: int, model: str,
                      batch_size: int = 0, threads: Any = None, stream: bool = False,
                      show_progress: bool = True, temperature: float = 0.0,
                      seed: int = 0, dtype: str = "float32") -> dict[str, Any]:
        calls.append({"name": name, "n": len(prompts), "m": output_len, "model": model,
                      "batch_size": batch_size, "stream": stream,
                      "temperature": temperature, "seed": seed, "dtype": dtype})
        return {"peer": name, "batch_size": batch_size or len(prompts), "threads": 2,
                "peak_rss_mb": 1.0, "load_s": 1.0, "num_prompts": len(prompts),
                "output_tokens": len(prompts) * output_len, **_figures(10.0, 0.5, 0.1),
                "wall_s": len(prompts) * output_len / 10.0,
                "output_ids": [[0] * output_len for _ in prompts]}

    monkeypatch.setattr(peer_mod, "run_peer", fake_run_peer)
    monkeypatch.setattr(peer_mod, "peer_python", lambda name: sys.executable)
    return calls


def _bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, Any]]:
    from multiserve.bench.run import bench_main

    assert bench_main(bench_options(*argv)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])


def test_batch_with_peer_prints_the_table(tiny_dir: Path, stub_peer: list[dict[str, Any]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    text, res = _bench(["--model", str(tiny_dir), "--num-prompts", "3", "--output-len", "4",
                        "--peer", "vllm", "--no-breakdown", *ENGINE_FLAGS], capsys)
    assert stub_peer == [{"name": "vllm", "n": 3, "m": 4, "model": str(tiny_dir),
                          "batch_size": 0, "stream": False, "temperature": 0.0, "seed": 0, "dtype": "float32"}]
    assert "ours vs vllm (same prompts, same run)" in text and "greedy outputs" in text
    assert "x 4 output tokens, greedy, ignore_eos" in text
    assert "step-time breakdown" not in text and res["breakdown"] is None
    assert res["temperature"] == 0.0 and res["seed"] == 0
    assert res["mode"] == "batch" and res["peer"]["peer"] == "vllm"
    assert res["ratio_vs_peer"] == pytest.approx(res["ours"]["tokens_per_s"] / 10.0)
    assert set(res["peer_agreement"]) == {"identical_fraction", "mean_common_prefix"}
    assert res["ours"]["exact_length"] and res["cache_miss_count"] == 0


def test_single_stream_with_peer(tiny_dir: Path, stub_peer: list[dict[str, Any]],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    text, res = _bench(["--model", str(tiny_dir), "--single-stream", "--output-len", "6",
                        "--peer", "llamacpp", "--peer-model", "/x.gguf", *ENGINE_FLAGS],
                       capsys)
    # the default 5 rounds, interleaved for llama.cpp: after each of ours, one peer process
    # for the prompt once, seeded as the same round of ours
    assert stub_peer == [{"name": "llamacpp", "n": 1, "m": 6, "model": "/x.gguf",
                          "batch_size": 1, "stream": True, "temperature": 0.0, "seed": i,
                          "dtype": "float32"} for i in range(5)]
    assert res["temperature"] == 0.0 and res["peer_agreement"] is not None
    assert "--single-stream" in text and "ours vs llamacpp" in text and "TTFT" in text
    assert "5 cold rounds on each side, ours and the peer's alternating" in text
    assert "peer, each round's tok/s (each after ours of the same index): " + " ".join(
        ["10.0"] * 5) in text
    peer = res["peer"]
    assert peer["interleaved"] and peer["num_prompts"] == 5 and peer["output_tokens"] == 30
    assert len(peer["rounds_tokens_per_s"]) == 5
    assert res["ratio_vs_peer"] == pytest.approx(res["ours"]["tokens_per_s"] / 10.0)
    assert "greedy rounds identical: yes" in text
    assert re.search(r"greedy outputs identical: \d+% of 5;", text)  # the rounds compared
    assert res["mode"] == "single_stream" and res["num_prompts"] == 1
    ours = res["ours"]
    assert ours["rounds"] == 5 and len(ours["rounds_tokens_per_s"]) == 5
    assert ours["rounds_identical"] and ours["steps"] >= 5 * 6
    assert ours["output_tokens"] == 5 * 6 and ours["exact_length"]
    assert 0 < ours["ttft_p50_s"] <= ours["wall_s"] and ours["tokens_per_s"] > 0
    assert res["ttft_s"] == ours["ttft_p50_s"] and res["targets"]["ttft_s"] == 0.3
    assert res["targets"]["vs_peer"] == 1.0 and res["targets"]["zero_recompiles_met"]


def test_single_stream_rounds_follow_ours_without_interleave(
        tiny_dir: Path, stub_peer: list[dict[str, Any]],
        capsys: pytest.CaptureFixture[str]) -> None:
    text, res = _bench(["--model", str(tiny_dir), "--single-stream", "--output-len", "4",
                        "--rounds", "3", "--peer", "llamacpp", "--peer-model", "/x.gguf",
                        "--no-interleave", *ENGINE_FLAGS], capsys)
    assert [(c["n"], c["seed"]) for c in stub_peer] == [(3, 0)]
    assert "3 cold rounds one after another on each side" in text
    assert "peer, each round's" not in text and "interleaved" not in res["peer"]


def test_peer_rounds_merge_like_ours() -> None:
    from multiserve.bench.single import merge_peer_rounds

    def part(tokens: int, wall: float, ttft: float, itl50: float, itl99: float,
             rss: float, ids: list[int]) -> dict[str, Any]:
        return {"peer": "llamacpp", "threads": 2, "batch_size": 1, "num_prompts": 1,
                "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                "ttft_p50_s": ttft, "ttft_p99_s": ttft, "itl_p50_s": itl50,
                "itl_p99_s": itl99, "peak_rss_mb": rss, "load_s": 0.2,
                "output_ids": [ids]}

    merged = merge_peer_rounds([part(64, 1.0, 0.05, 0.010, 0.020, 300.0, [1, 2]),
                                part(64, 0.6, 0.07, 0.012, 0.030, 310.0, [1, 2]),
                                part(64, 0.8, 0.06, 0.011, 0.025, 305.0, [1, 3])])
    assert merged["tokens_per_s"] == pytest.approx(192 / 2.4)  # all tokens / summed walls
    assert merged["output_tokens"] == 192 and merged["num_prompts"] == 3
    assert merged["ttft_p50_s"] == pytest.approx(0.06)
    assert merged["itl_p50_s"] == pytest.approx(0.011) and merged["itl_p99_s"] == 0.030
    assert merged["output_ids"] == [[1, 2], [1, 2], [1, 3]]
    assert merged["peak_rss_mb"] == 310.0 and merged["interleaved"]
    assert merged["rounds_tokens_per_s"] == pytest.approx([64.0, 64 / 0.6, 80.0])
    with pytest.raises(AssertionError):
        merge_peer_rounds([])


def test_single_stream_target_follows_the_dtype() -> None:
    from multiserve.bench.single import target_vs_peer

    assert target_vs_peer("float32") == 1.0 and target_vs_peer(None) == 1.0
    assert target_vs_peer("bfloat16") == 1.2


def test_single_stream_sampled(tiny_dir: Path, stub_peer: list[dict[str, Any]],
                               capsys: pytest.CaptureFixture[str]) -> None:
    text, res = _bench(["--model", str(tiny_dir), "--single-stream", "--output-len", "5",
                        "--temperature", "0.5", "--seed", "3", "--peer", "vllm",
                        "--rounds", "2", *ENGINE_FLAGS], capsys)
    assert stub_peer[0]["temperature"] == 0.5 and stub_peer[0]["seed"] == 3
    assert stub_peer[0]["n"] == 2 and res["ours"]["rounds"] == 2
    assert "2 cold rounds one after another" in text and "greedy rounds" not in text
    # interleaved (asked for, with vLLM): each peer round keeps its own seed
    stub_peer.clear()
    _bench(["--model", str(tiny_dir), "--single-stream", "--output-len", "5",
            "--temperature", "0.5", "--seed", "3", "--peer", "vllm", "--rounds", "2",
            "--interleave", *ENGINE_FLAGS], capsys)
    assert [(c["n"], c["seed"]) for c in stub_peer] == [(1, 3), (1, 4)]
    assert res["temperature"] == 0.5 and res["seed"] == 3
    assert "x 5 output tokens, sampled (temperature 0.5, seed 3), ignore_eos" in text
    assert res["peer_agreement"] is None and "not expected to agree" in res[
        "peer_agreement_note"]
    assert res["ours"]["exact_length"] and "outputs not compared" in text


def test_rounds_below_one_are_refused_before_start_up(tiny_dir: Path) -> None:
    from multiserve.bench.run import bench_main

    options = bench_options("--model", str(tiny_dir), "--single-stream", "--rounds", "0")
    with pytest.raises(SystemExit, match="--rounds must be >= 1"):
        bench_main(options)


def test_llamacpp_peer_needs_a_gguf(tiny_dir: Path, stub_peer: list[dict[str, Any]]) -> None:
    from multiserve.bench.run import bench_main

    options = bench_options("--model", str(tiny_dir), "--peer", "llamacpp")
    with pytest.raises(SystemExit, match="needs a .gguf file"):
        bench_main(options)


def _check_breakdown(bd: dict[str, Any]) -> None:
    """The breakdown's figures: every measured component positive, the derived figures
    consistent (whether the parts fit in the forward is a timing fact, only reported)."""
    ms = bd["ms"]
    for key in ("forward", "products", "attention", "sampler", "wall_step"):
        assert ms[key] > 0, (key, ms)
    assert bd["parts_within_forward"] == (ms["products"] + ms["attention"] <= ms["forward"])
    assert bd["parts_ms"]["head_program"] > 0
    assert ms["other_device"] == pytest.approx(ms["forward"] - ms["products"]
                                               - ms["attention"])
    assert ms["device_step"] > 0
    assert ms["step_glue"] == pytest.approx(ms["device_step"] - ms["forward"] - ms["sampler"])
    assert ms["host"] == pytest.approx(ms["wall_step"] - ms["device_step"])
    assert bd["share_of_wall_step"]["wall_step"] == pytest.approx(1.0)
    parts = bd["parts_ms"]
    assert parts["decoder"] + parts["head"] == pytest.approx(ms["forward"])
    assert parts["layer_products"] + parts["head"] == pytest.approx(ms["products"])
    assert bd["steady"]["decode_step_ms"] > 0


def test_batch_sampled_with_peer_and_breakdown(tiny_dir: Path, stub_peer: list[dict[str, Any]],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature 1 --seed 7: the JSON and the report show them, the peer gets them,
    the agreement is null with a reason, both overlap runs draw the same ids (the seeds
    are per request), and the breakdown is printed and in the JSON."""
    text, res = _bench(["--model", str(tiny_dir), "--num-prompts", "2", "--output-len", "4",
                        "--temperature", "1", "--seed", "7", "--ab-overlap", "--peer", "vllm",
                        *ENGINE_FLAGS], capsys)
    assert stub_peer[0]["temperature"] == 1.0 and stub_peer[0]["seed"] == 7
    assert res["temperature"] == 1.0 and res["seed"] == 7
    assert "sampled (temperature 1, request i seeded 7 + i)" in text
    assert res["peer_agreement"] is None and "temperature 1 > 0" in res["peer_agreement_note"]
    assert "outputs not compared: temperature 1 > 0" in text
    assert res["overlap_outputs_identical"] is True
    assert res["ours"]["exact_length"] and res["cache_miss_count"] == 0
    bd = res["breakdown"]
    assert bd["rows"] == 2 and bd["tokens"] == 64 and bd["logit_rows"] == 64  # the buckets
    assert bd["decode_steps"] == res["ours"]["decode_steps"] > 0
    _check_breakdown(bd)
    assert "step-time breakdown" in text
    for label in ("forward", "products", "attention", "other device work", "sampler",
                  "step glue", "device step", "host", "wall step"):
        assert any(ln.strip().startswith(label) for ln in text.splitlines()), label


def test_sampled_runs_are_reproducible_per_seed(tiny_dir: Path) -> None:
    """run_once with temperature 1: the same seed twice gives the same ids; another seed
    other ids; request i is seeded seed + i (a prompt sent twice draws differently, and
    seed 8's request 0 draws what seed 7's request 1 drew from the same prompt)."""
    from multiserve.bench.ours import run_once
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(tiny_dir), precompile_token_paddings=(64,),
                                 precompile_bs_paddings=(64,), max_running_requests=64,
                                 chunked_prefill_size=64, max_total_tokens=4096,
                                 show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX))
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11]]

    def ids(desc: str, seed: int) -> list[list[int]]:
        run = run_once(engine, prompts, 6, overlap=True, desc=desc, show_progress=False,
                       temperature=1.0, seed=seed)
        assert run["exact_length"] and run["kv_returned"]
        return run["output_ids"]

    try:
        first, again, other = ids("a", 7), ids("b", 7), ids("c", 8)
    finally:
        engine.shutdown()
    assert again == first
    assert first[0] != first[1]  # one prompt, seeds 7 and 8
    assert other[0] == first[1]  # seed 8 on that prompt, in another run and row
    assert other[1] != first[1] and other[2] != first[2]
