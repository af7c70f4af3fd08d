"""`multiserve bench --agent-sessions S --agent-turns T` on a tiny model: the 4-engine fleet
with its front door; the same multi-turn sessions through the front door (sticky by
X-Session-ID), over random engine ports, and through sglang-router (cache_aware) when it
is installed. What is checked is the plumbing and the figures' consistency, not speed:
every arm served every turn, the front door kept each session on one engine (so its
later turns hit the prefix cache), and the transcripts are identical in every arm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_args import bench_options
from tiny_model import save_tiny_model

FLAGS = ["--no-progress", "--max-total-tokens", "4096", "--token-paddings", "64",
         "--chunked-prefill-size", "64", "--bs-paddings", "8", "--max-running", "8"]


def test_agent_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multiserve.bench.run import bench_main

    model = save_tiny_model(tmp_path / "tiny")
    assert bench_main(bench_options("--agent-sessions", "3", "--agent-turns", "3",
                                    "--model", str(model), *FLAGS)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert "agent benchmark: 3 sessions x 3 turns" in "\n".join(lines[:-1])
    try:
        import sglang_router  # noqa: F401
        want = {"random_ports", "front_door", "sglang_router"}
    except ImportError:
        want = {"random_ports", "front_door"}
    assert set(res["arms"]) == want
    for arm in res["arms"].values():
        assert arm["requests"] == 9 and arm["completion_tokens"] > 0
        assert 0 <= arm["cached_tokens"] <= arm["prompt_tokens"]
        assert arm["prefix_hit_rate"] == pytest.approx(arm["cached_tokens"] /
                                                       arm["prompt_tokens"])
    door = res["arms"]["front_door"]
    assert sum(door["requests_per_engine"]) == 9
    assert door["cached_tokens"] > 0  # turns 2 and 3 of a session find its prefix
    assert res["front_door_stats"]["by_reason"]["sticky"] >= 6
    assert res["outputs_identical"] is True
