"""Tensor parallel in the fleet: configs/cpu-2x2.toml (2 engines x 2 virtual devices)
against a one-engine, one-device fleet with the same engine settings, real servers, on
the tiny random model (reliability/tiny_model.py).

What is checked: every TP engine's params and KV are spread over exactly its own two
devices, and both TP engines give the same greedy answers as the single device.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from multiserve.engine.commands import Call
from multiserve.fleet.config_loader import load_fleet_config
from multiserve.fleet.launch import Fleet, launch_fleet

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The tiny random model (full tokenizer vocabulary) and one small bucket pair for both
# fleets (3 short chats): what is compared is sharded vs unsharded arithmetic on the same
# weights, which needs no real model (nor other buckets: row invariance); the TP engines'
# sharded programs then compile in seconds.
SMALL = {"fleet.supervisor_port": 0, "engine.max_total_tokens": 4096,
         "engine.show_progress": False, "engine.precompile_token_paddings": [64],
         "engine.precompile_bs_paddings": [8], "engine.chunked_prefill_size": 64,
         "engine.max_running_requests": 8, "engine.max_context_len": 2048}
PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write one sentence about the sea."]
MAX_TOKENS = 20
DRAIN_TOKENS = 1500  # a stream long enough (seconds) to still run when the drain begins


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from multiserve.reliability.tiny_model import write_tiny_model

    return {**SMALL, "model.path": str(write_tiny_model(tmp_path_factory.mktemp("tiny-tp")))}


async def answers(fleet: Fleet, i: int) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{fleet.urls[i]}/v1", api_key="none",
                                  max_retries=0, timeout=120) as c:
        out = await asyncio.gather(*(c.chat.completions.create(
            model=fleet.workers[i].model_name, messages=[{"role": "user", "content": p}],
            temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
            for p in PROMPTS))
    return [r.choices[0].message.content for r in out]


@pytest.fixture(scope="module")
def single(tiny: dict[str, str]) -> Iterator[Fleet]:
    cfg = load_fleet_config(CONFIGS / "cpu-4.toml", {**tiny, "fleet.base_port": 0,
                                                     "engines": [{"device_indexes": [0]}]})
    fleet = launch_fleet(cfg, announce=False)
    yield fleet
    fleet.stop("abort")


@pytest.fixture(scope="module")
def single_device_answers(single: Fleet) -> list[str]:
    return asyncio.run(answers(single, 0))


def test_two_engines_of_two_devices_match_one_device(single_device_answers: list[str],
                                                    tiny: dict[str, str]) -> None:
    import jax

    cfg = load_fleet_config(CONFIGS / "cpu-2x2.toml", {**tiny, "fleet.ports": [0, 0]})
    fleet = launch_fleet(cfg, announce=False)
    try:
        assert fleet.device_groups == [[0, 1], [2, 3]]
        for w in fleet.workers:
            params, kv = w.engine.call(Call(lambda c: (c.runner.params, c.runner.kv))).result()
            mine = {jax.devices()[i] for i in w.device_indexes}
            leaves = jax.tree.leaves((params, kv))
            assert all(x.devices() == mine for x in leaves)  # on both devices, nowhere else
            assert any(not x.sharding.is_fully_replicated for x in leaves)  # really sharded
            assert w.engine.get_internal_state()["tp_size"] == 2  # sglang's server-info key

        async def both() -> list[list[str]]:
            return list(await asyncio.gather(answers(fleet, 0), answers(fleet, 1)))

        tp0, tp1 = asyncio.run(both())
    finally:
        fleet.stop("abort")
    assert all(single_device_answers)
    assert tp0 == single_device_answers
    assert tp1 == single_device_answers


async def test_drain_shutdown_finishes_in_flight_requests_and_refuses_new_ones(
        single: Fleet, single_device_answers: list[str]) -> None:
    """Runs last: it stops the one-device fleet the way SIGTERM with --shutdown-mode
    drain does."""
    url, model = single.urls[0], single.workers[0].model_name
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=120) as c:
        whole = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0,
            max_tokens=DRAIN_TOKENS, extra_body={"ignore_eos": True})
        stream = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0,
            max_tokens=DRAIN_TOKENS, stream=True, extra_body={"ignore_eos": True})
        chunks = aiter(stream)
        first = await anext(chunks)
        stopper = threading.Thread(target=single.stop, args=("drain", 60.0))
        stopper.start()
        async with httpx.AsyncClient(base_url=url) as h:
            while (await h.get("/health")).status_code == 200:  # until the drain begins
                pass
            with pytest.raises(openai.APIStatusError) as refused:
                await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert refused.value.status_code == 503
        text = "".join(ch.choices[0].delta.content or "" for ch in [first] if ch.choices)
        finish = None
        async for ch in chunks:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
    await asyncio.to_thread(stopper.join, 120)
    assert not stopper.is_alive()
    assert finish == "length" and text == whole.choices[0].message.content
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
