"""The rollout client (plugins/rollout) driving a toy RL loop on real engines (issue 7).

Two engines on separate virtual devices (0 and 1), the tiny random model
(reliability/tiny_model.py: what is tested is the loop's mechanics, not the model's text)
with small CPU buckets. The
test plays the trainer: it holds the weights as a numpy pytree, perturbs them, and pushes
them through the client while a rollout is in flight (pause retract -> fleet-wide update
-> continue), for 3 iterations; then the same over HTTP (per-engine ports + supervisor).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shipped_engine import SHIPPED_FUSED_STEP_MAX

from plugins.rollout import RolloutClient, RolloutError, RolloutResult

pytestmark = pytest.mark.slow

ENGINE_KW: dict[str, Any] = dict(
    page_size=16, max_total_tokens=4096, max_running_requests=64, max_context_len=2048,
    chunked_prefill_size=256, precompile_bs_paddings=(64,), precompile_token_paddings=(64, 256),
    show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)
QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea.", "What is 12 times 7?",
             "Who wrote Hamlet?", "Give me a synonym for happy."]
GEN = dict(temperature=0.0, ignore_eos=True)
N = 6  # tokens per reference rollout
MIXED = 64  # tokens of the rollout that spans an update (its pause must land before the
# rollout ends: 62 steps of slack after wait_tokens(2))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from multiserve.reliability.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-rollout"))


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[list[Any]]:
    from multiserve import Engine
    from multiserve.config import EngineConfig

    built = [Engine(EngineConfig(model_path=str(model_dir), device_indexes=(d,), **ENGINE_KW))
             for d in (0, 1)]
    yield built
    for e in built:
        e.shutdown()


@pytest.fixture(scope="module")
def trainer_params(model_dir: Path) -> dict:
    """What the trainer holds: the model's params as a numpy pytree."""
    from multiserve.model.loading.loader import load_model

    return load_model(model_dir, np.float32).params


@pytest.fixture(scope="module")
def prompts(engines: list[Any]) -> list[list[int]]:
    return [engines[0].chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def baseline(engines: list[Any], prompts: list[list[int]]) -> list[RolloutResult]:
    client = RolloutClient.from_engines(engines)
    out = client.generate(prompts, max_tokens=N, **GEN)
    client.close()
    return out


def perturb(params: dict, seed: int, scale: float = 0.1) -> dict:
    rng = np.random.default_rng(seed)

    def f(a: np.ndarray) -> np.ndarray:
        noise = rng.standard_normal(a.shape, dtype=np.float32)
        return a * (1 + scale * noise)

    return {k: ({kk: f(vv) for kk, vv in v.items()} if k == "layers" else f(v))
            for k, v in params.items()}


def _misses(engines: list[Any]) -> list[int]:
    return [e.get_internal_state()["cache_miss_count"] for e in engines]


def test_toy_rl_loop(engines: list[Any], trainer_params: dict, prompts: list[list[int]],
                     baseline: list[RolloutResult]) -> None:
    misses = _misses(engines)
    client = RolloutClient.from_engines(engines)
    assert {r.engine for r in baseline} == {0, 1}  # the batch is spread over the fleet
    assert all(r.segments == ((0, "default"),) for r in baseline)
    previous = "default"
    for it in (1, 2):  # two updates: v1 spans default, v2 spans v1
        new = perturb(trainer_params, it)
        version = f"v{it}"
        handle = client.start(prompts, max_tokens=MIXED, **GEN)
        handle.wait_tokens(2)  # some tokens exist: the update lands mid-rollout
        client.pause("retract")
        client.update_params(new, version)
        client.resume()
        mixed = handle.result()
        assert len(mixed) == len(prompts)  # nothing lost
        spanning = 0
        for r in mixed:
            assert r.finish_reason == "length" and len(r.token_ids) == MIXED
            assert len(r.logprobs) == MIXED and r.weight_version == version
            assert r.segments[-1][1] == version and r.segments[0][0] == 0
            if len(r.segments) == 2:
                spanning += 1
                assert r.segments[0][1] == previous and 0 < r.segments[1][0] < MIXED
                assert r.version_of_token(0) == previous
                assert r.version_of_token(MIXED - 1) == version
        assert spanning >= 1, "no request spanned the update"
        after = client.generate(prompts, max_tokens=N, **GEN)
        assert all(r.segments == ((0, version),) for r in after)
        assert sum(a.token_ids != b.token_ids for a, b in zip(after, baseline)) >= 1
        previous = version
    assert client.weight_versions() == ["v2", "v2"]
    client.update_params(trainer_params, "v0")  # idle fleet: no pause needed
    restored = client.generate(prompts, max_tokens=N, **GEN)
    assert [r.token_ids for r in restored] == [r.token_ids for r in baseline]
    assert [r.logprobs for r in restored] == [r.logprobs for r in baseline]
    assert _misses(engines) == misses  # no recompilation after any update
    client.close()


def test_update_refused_while_running_then_abort_and_resume(
        engines: list[Any], prompts: list[list[int]], baseline: list[RolloutResult],
        trainer_params: dict) -> None:
    client = RolloutClient.from_engines(engines)
    versions = client.weight_versions()
    handle = client.start(prompts, max_tokens=N, **GEN)
    handle.wait_tokens(1)
    with pytest.raises(RolloutError, match="not applied .*engine 0: cannot update weights"):
        client.update_params(trainer_params, "refused")
    client.abort_all()
    partial = handle.result()
    assert any(r.finish_reason == "abort" for r in partial)
    assert client.weight_versions() == versions
    resumed = client.resume_aborted(partial, max_tokens=N, **GEN)
    assert [r.token_ids for r in resumed] == [r.token_ids for r in baseline]
    client.close()


def test_over_http_with_supervisor(engines: list[Any], prompts: list[list[int]],
                                   baseline: list[RolloutResult], trainer_params: dict,
                                   tmp_path: Path) -> None:
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
    from multiserve.model.loading.hf_names import params_to_hf
    from multiserve.server.app import build_app
    from multiserve.server.control_routes import add_rl_routes
    from multiserve.server.server_thread import ServerThread
    from multiserve.server.tokenizer import TokenizerManager

    servers = []
    for e in engines:
        app = build_app(e, TokenizerManager(e.tokenizer_dir, e.context_len, e.model_name))
        add_rl_routes(app, e)
        servers.append(ServerThread(app).start())
    sup_app = build_supervisor_app(engines)
    add_rl_supervisor_routes(sup_app)
    servers.append(ServerThread(sup_app).start())
    client = RolloutClient.from_http([s.url for s in servers[:2]], servers[2].url)
    try:
        got = client.generate(prompts, max_tokens=N, **GEN)
        assert [r.token_ids for r in got] == [r.token_ids for r in baseline]
        assert all(r.weight_version == "v0" for r in got)
        cfg = engines[0].model_config
        named = params_to_hf(perturb(trainer_params, 1), cfg)
        client.pause("retract")
        client.update_params(named, "http-v1")  # written to a dir, fleet-wide 2-phase
        client.resume()
        assert client.weight_versions() == ["http-v1", "http-v1"]
        after = client.generate(prompts, max_tokens=2, **GEN)
        assert all(r.segments == ((0, "http-v1"),) for r in after)
        client.release_memory()
        assert all(e.health()[1].startswith("asleep") for e in engines)
        client.resume_memory()
        with pytest.raises(RolloutError, match="not a directory"):
            client.update_params(str(tmp_path / "missing"), "never")
        assert client.weight_versions() == ["http-v1", "http-v1"]
    finally:
        client.close()
        for s in servers:
            s.stop()
        RolloutClient.from_engines(engines).update_params(trainer_params, "v0")
