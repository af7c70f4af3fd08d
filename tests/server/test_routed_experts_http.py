"""Routing replay over HTTP as SGLang serves it (`return_routed_experts` on /generate, a
Qwen3-MoE server started with the option): meta_info.routed_experts is base64 of int32
[prompt + output - 1 - routed_experts_start_len, layers, top_k], equal to transformers'
router top-k for the same tokens (-1 in the dense layer), on the final object or the final
chunk only; an aborted request's partial output carries its rows (slime's partial rollout).
Refused with a 400 naming the field: a dense model, a start past the prompt, a bad value;
the OpenAPI document describes the fields."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from loopback_server import engine_server
from moe_checkpoints import hf_router_topk, make_model, save
from shipped_engine import SHIPPED_FUSED_STEP_MAX

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
PROMPT = [17, 301, 45, 99, 250, 8, 400, 12, 77]
LAYERS, TOP_K = 3, 2
# the server tests' engine settings (tests/server/conftest.py ENGINE_KW)
MOE_ENGINE_KW: dict[str, Any] = dict(
    max_running_requests=64, precompile_bs_paddings=(64,), precompile_token_paddings=(64, 256),
    chunked_prefill_size=256, max_total_tokens=16384, max_context_len=2048,
    show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)
BUDGET = 512  # tokens: far more than those made between the interruption's requests


def decode(meta: dict[str, Any]) -> np.ndarray:
    """slime's decoding: base64 -> int32 -> [rows, layers, top_k]."""
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32).reshape(
        -1, LAYERS, TOP_K)


def hf_rows(model: Any, tokens: list[int]) -> np.ndarray:
    got = hf_router_topk(model, tokens)
    rows = np.full((len(tokens), LAYERS, TOP_K), -1, np.int32)
    for i, ids in got.items():
        rows[:, i] = ids
    return rows


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return make_model("qwen3_moe", seed=11)


@pytest.fixture(scope="module")
def moe_url(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    path = save(hf_model, tmp_path_factory.mktemp("moe-http"))
    eng = Engine(EngineConfig(model_path=str(path), enable_return_routed_experts=True,
                              **MOE_ENGINE_KW))
    with engine_server(eng) as url:
        yield url
    eng.shutdown()


def _body(**kw: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            **kw}


def test_generate_returns_sglang_routed_experts(moe_url: str, hf_model: Any) -> None:
    with httpx.Client(base_url=moe_url, timeout=120) as h:
        out = h.post("/generate", json=_body()).json()
        ids = out["output_ids"]
        meta = out["meta_info"]
        assert isinstance(meta["routed_experts"], str)
        rows = decode(meta)
        assert rows.shape == (len(PROMPT) + len(ids) - 1, LAYERS, TOP_K)
        np.testing.assert_array_equal(rows, hf_rows(hf_model, PROMPT + ids[:-1]))
        # from routed_experts_start_len on
        part = h.post("/generate", json=_body(routed_experts_start_len=len(PROMPT))).json()
        np.testing.assert_array_equal(decode(part["meta_info"]), rows[len(PROMPT):])
        # streamed: on the final chunk only, the same bytes
        chunks = []
        with h.stream("POST", "/generate", json=_body(stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert [("routed_experts" in c["meta_info"]) for c in chunks] == \
            [False] * (len(chunks) - 1) + [True]
        assert chunks[-1]["meta_info"]["routed_experts"] == meta["routed_experts"]
        # a batch of two prompts, two samples each: every sample its own rows
        batch = h.post("/generate", json=_body(
            input_ids=[PROMPT, PROMPT[:5]], sampling_params={
                "temperature": 1.0, "seed": 3, "n": 2, "max_new_tokens": 4})).json()
        assert len(batch) == 4
        for o, prompt in zip(batch, [PROMPT, PROMPT, PROMPT[:5], PROMPT[:5]], strict=True):
            np.testing.assert_array_equal(decode(o["meta_info"]),
                                          hf_rows(hf_model, prompt + o["output_ids"][:-1]))
        # without the field (or null): no routing in the answer
        for unset in ({}, {"return_routed_experts": None}):
            assert "routed_experts" not in h.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, **unset}
            ).json()["meta_info"]


def _abort_rid(c: httpx.Client) -> None:
    assert c.post("/abort_request", json={"rid": "routed-abort"}).json()["success"]


def _abort_all(c: httpx.Client) -> None:
    assert c.post("/abort_request", json={"abort_all": True}).json()["success"]


def _pause_abort(c: httpx.Client) -> None:  # continue, then pause in abort mode (SkyRL)
    assert c.post("/continue_generation", json={}).status_code == 200
    assert c.post("/pause_generation", json={"mode": "abort"}).status_code == 200


@pytest.mark.parametrize("interrupt", [_abort_rid, _abort_all, _pause_abort],
                         ids=["abort_rid", "abort_all", "pause_abort"])
def test_aborted_output_carries_its_rows(moe_url: str, interrupt: Any) -> None:
    """As tests/server/test_partial_rollouts.py: the partial output's rows, a prefix of the
    uninterrupted request's."""
    body = _body(stream=True, rid="routed-abort", sampling_params={
        "temperature": 0.0, "max_new_tokens": BUDGET, "ignore_eos": True})
    with httpx.Client(base_url=moe_url, timeout=120) as h:
        full = h.post("/generate", json={**body, "stream": False, "rid": None}).json()
        last: dict[str, Any] = {}
        with h.stream("POST", "/generate", json=body) as r:
            done = threading.Event()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = json.loads(line[6:])
                if not done.is_set() and len(last["output_ids"]) >= 3:
                    done.set()  # paused in place (nothing runs), then aborted: certain
                    with httpx.Client(base_url=moe_url, timeout=120) as c:
                        assert c.post("/pause_generation",
                                      json={"mode": "in_place"}).status_code == 200
                        interrupt(c)
                        assert c.post("/continue_generation", json={}).status_code == 200
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    k = len(last["output_ids"])
    assert 3 <= k < BUDGET and last["output_ids"] == full["output_ids"][:k]
    np.testing.assert_array_equal(decode(meta),
                                  decode(full["meta_info"])[:len(PROMPT) + k - 1])


@pytest.mark.parametrize(("extra", "param"), [
    ({"routed_experts_start_len": len(PROMPT) + 1}, "routed_experts_start_len"),
    ({"routed_experts_start_len": -1}, "routed_experts_start_len"),
    ({"return_routed_experts": "yes"}, "return_routed_experts"),
])
def test_bad_values_are_400s(moe_url: str, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{moe_url}/generate", json=_body(**extra), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in err["message"] or err.get("param") == param, err


def test_openapi_documents_the_fields(moe_url: str) -> None:
    doc = httpx.get(f"{moe_url}/openapi.json", timeout=60).json()["components"]["schemas"]
    body = doc["GenerateRequestBody"]["properties"]
    assert {"type": "boolean"} in body["return_routed_experts"]["anyOf"]
    assert "--enable-return-routed-experts" in body["return_routed_experts"]["description"]
    assert body["routed_experts_start_len"]["minimum"] == 0
    assert "routed_experts" in doc["GenerateMetaInfo"]["properties"]


def test_dense_model_and_openai_routes_refuse(served: Any) -> None:
    r = served.http.post("/generate", json={"text": "hi", "return_routed_experts": True})
    assert r.status_code == 400
    assert "is dense" in r.json()["error"]["message"]
    r = served.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "return_routed_experts": True})
    assert r.status_code == 400
    assert "/generate only" in r.json()["error"]["message"]
