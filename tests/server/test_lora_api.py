"""LoRA over HTTP (issue 47) on a real server for a tiny-model engine with one adapter
slot: sglang's /load_lora_adapter and /unload_lora_adapter (vLLM's /v1/ spellings too),
/v1/models listing adapters, `lora_path` on /generate and `model: <adapter>` on the OpenAI
endpoints, and the refusals' statuses: 400 a bad adapter (nothing loaded), 400 an unknown
adapter in a request (named), 404 unloading an unknown one, 409 a full slot table, 409
unloading an adapter live requests use (their count named)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_checkpoints import write_peft_dir

PROMPT = [5, 9, 13, 17, 21, 25]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.reliability.tiny_model import tiny_engine_fields, write_tiny_model
    from multiserve.server import ServerThread, TokenizerManager, build_app

    from multiserve.reliability.tiny_model import TINY_RELIABILITY_MODEL

    model = write_tiny_model(tmp_path_factory.mktemp("tiny-lora"))
    adapters = tmp_path_factory.mktemp("adapters")
    start = write_peft_dir(adapters / "start", TINY_RELIABILITY_MODEL, 2, 0)
    eng = Engine(EngineConfig(model_path=str(model), **tiny_engine_fields(
        max_loras_per_batch=1, max_lora_rank=4, lora_paths=(f"start={start}",))))
    tm = TokenizerManager(eng.tokenizer_dir, eng.context_len, eng.model_name,
                          tokenizer=eng.tokenizer)
    thread = ServerThread(build_app(eng, tm)).start()
    http = httpx.Client(base_url=thread.url, timeout=120)
    yield eng, http, adapters
    http.close()
    thread.stop()
    eng.shutdown()


def test_lora_paths_are_loaded_at_start(server: Any) -> None:
    eng, http, root = server
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [
        eng.model_name, "start"]
    assert _generate(http, lora_path="start").status_code == 200
    r = http.post("/unload_lora_adapter", json={"lora_name": "start"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}


def _generate(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                        **body})


def test_load_serve_and_unload_an_adapter(server: Any) -> None:
    eng, http, root = server
    path = write_peft_dir(root / "a", eng.model_config, 4, 1)
    base = _generate(http).json()["output_ids"]
    r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(path)})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["loaded_adapters"] == {"a": str(path)}
    try:
        ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert ids == [eng.model_name, "a"]
        tuned = _generate(http, lora_path="a").json()["output_ids"]
        assert tuned != base
        # per prompt in a batch: base, adapter
        both = http.post("/generate", json={"input_ids": [PROMPT, PROMPT],
                                            "sampling_params": GREEDY,
                                            "lora_path": [None, "a"]}).json()
        assert [o["output_ids"] for o in both] == [base, tuned]
        # OpenAI: the adapter by name in `model`; the served model's name, or any other
        # name (RL clients send the model's path), is the base model
        for model, want in (("a", tuned), (eng.model_name, base), ("/some/path", base)):
            c = http.post("/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert c.status_code == 200, c.text
            got = eng.encode(c.json()["choices"][0]["text"])
            assert got == eng.encode(eng.decode(want)), model
    finally:
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})  # vLLM's path
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [eng.model_name]


def test_refusals_answer_their_status_and_change_nothing(server: Any) -> None:
    eng, http, root = server
    big = write_peft_dir(root / "big", eng.model_config, 8, 2)
    r = http.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and "max_lora_rank" in r.json()["message"]
    r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "no")})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["message"]
    r = _generate(http, lora_path="nope")
    assert r.status_code == 400 and "'nope'" in r.text
    r = http.post("/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and "'nope'" in r.json()["message"]
    path = write_peft_dir(root / "b", eng.model_config, 2, 3)
    assert http.post("/load_lora_adapter", json={"lora_name": "b",
                                                 "lora_path": str(path)}).status_code == 200
    try:
        r = http.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(path)})
        assert r.status_code == 409 and "every LoRA slot is taken" in r.json()["message"]
        _unload_in_use_is_refused(http)
    finally:
        assert http.post("/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert [a["name"] for a in eng.list_lora_adapters()] == []


def _unload_in_use_is_refused(http: httpx.Client) -> None:
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    answers: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answers.append(_generate(http, lora_path="b")))
    waiting.start()
    try:
        def queued() -> bool:
            return http.get("/get_server_info").json()["waiting_queue_size"] == 1

        for _ in range(2000):  # a condition, polled: the request reached the engine
            if queued():
                break
            threading.Event().wait(0.01)
        assert queued()
        r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 409, r.text
        assert "in use by 1 live request" in r.json()["message"]
    finally:
        http.post("/continue_generation")
        waiting.join()
    assert answers[0].status_code == 200


def test_load_inplace_replaces_a_loaded_adapter(server: Any) -> None:
    """sglang's `load_inplace: true` (prime-rl's reload after a training step): the new
    version under the same name from the next request on (no live request holds the old
    one here, so it takes the one slot); without it the name is refused 409."""
    eng, http, root = server
    v1 = write_peft_dir(root / "v1", eng.model_config, 4, 7)
    v2 = write_peft_dir(root / "v2", eng.model_config, 4, 8)
    r = http.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": str(v1)})
    assert r.status_code == 200, r.text
    try:
        first = _generate(http, lora_path="p").json()["output_ids"]
        r = http.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": str(v2)})
        assert r.status_code == 409 and "already loaded" in r.json()["message"]
        r = http.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": str(v2),
                                                  "load_inplace": True})
        assert r.status_code == 200 and r.json()["replaced"], r.text
        assert r.json()["message"].startswith("replaced") and r.json()["slot"] == 1
        assert r.json()["loaded_adapters"] == {"p": str(v2)}
        second = _generate(http, lora_path="p").json()["output_ids"]
        assert second != first
        r = http.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": str(v1),
                                                  "load_inplace": True})
        assert r.status_code == 200
        assert _generate(http, lora_path="p").json()["output_ids"] == first
    finally:
        http.post("/unload_lora_adapter", json={"lora_name": "p"})
