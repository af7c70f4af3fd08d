"""Issue 64's families across hosts: GPT-OSS (routed experts with biases, attention sinks,
window and full layers; tests/family_checkpoints.py, a checkpoint transformers wrote) as ONE
engine tensor-parallel over 2 processes x 1 virtual CPU device (multi-controller JAX, gloo)
gives, bit for bit, the ids and logprobs of the same engine over 2 devices in one process
with the same collectives and the same pinned plan: greedy and seeded, batched and alone.
The Llama-shaped checks of every control across hosts are test_multihost_engine.py's; what
this adds is a family whose expert, sink and window weights split over the hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_checkpoints import make_model
from moe_checkpoints import VOCAB, save

from tests.multihost.slice_procs import free_port_pair, run_slice

pytestmark = pytest.mark.slow


def test_gpt_oss_across_two_hosts_gives_the_one_process_bits(tmp_path: Path) -> None:
    ckpt = save(make_model("gpt_oss", seed=7), tmp_path / "gpt-oss")
    plan = tmp_path / "plan.json"
    env = {"NODE_DEVICES": "1", "NODE_VOCAB": str(VOCAB)}
    one = run_slice(tmp_path, "bits", 0, ckpt, REF_DEVICES="2", REF_GLOO=str(free_port_pair()),
                    NODE_PLAN_OUT=str(plan), **env)
    two = run_slice(tmp_path, "bits", 2, ckpt, NODE_PLAN=str(plan), **env)
    assert one["plan_verified"] and two["plan_verified"]
    assert all(o["error"] is None and len(o["ids"]) == 12 for o in two["batch"])
    assert all(o["logprobs"] is not None for o in two["batch"])
    assert two["batch"] == one["batch"] and two["alone"] == one["alone"]
    assert two["alone"] == two["batch"][0]  # alone = batched, across hosts too
    assert two["batch"][0]["ids"] != two["batch"][3]["ids"]  # the seed reached the sampler
