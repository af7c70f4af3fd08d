"""Token ids on the OpenAI endpoints (vLLM's `return_token_ids`,
`return_tokens_as_token_ids`) and vLLM's token-in / token-out `/inference/v1/generate`,
through the official openai client and plain HTTP against a real server + real engine:
the ids equal the native /generate's for the same request, streamed = non-streamed, the
prompt ids equal the tokenizer's."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]
IDS = {"return_token_ids": True}


def _native_ids(served, prompt_ids: list[int], sampling: dict[str, Any]) -> list[list[int]]:
    """Each sample's output_ids from the native /generate for the same prompt ids."""
    r = served.http.post("/generate", json={"input_ids": prompt_ids,
                                            "sampling_params": sampling})
    assert r.status_code == 200, r.text
    out = r.json()
    return [o["output_ids"] for o in (out if isinstance(out, list) else [out])]


def _sse(served, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with served.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_chat_token_ids_equal_native_and_stream(client, served, hf_tok, idle_engine):
    kw: dict[str, Any] = dict(model="m", messages=MSGS, max_tokens=8, temperature=0,
                              extra_body={**IDS, "ignore_eos": True})
    r = client.chat.completions.create(**kw).model_dump()
    prompt = hf_tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert r["prompt_token_ids"] == prompt
    (ids,) = [c["token_ids"] for c in r["choices"]]
    assert len(ids) == 8 == r["usage"]["completion_tokens"]
    assert [ids] == _native_ids(served, prompt, {"max_new_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True})
    # streamed: the prompt ids on the first chunk only, the new ids chunk by chunk
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **kw)]
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == ids
    # without the flag: no ids at all
    plain = client.chat.completions.create(model="m", messages=MSGS, max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_token_ids_n2_and_stream(client, served, idle_engine):
    prompts = ["The sea is", "Mountains are"]
    kw: dict[str, Any] = dict(model="m", prompt=prompts, max_tokens=6, n=2, seed=7,
                              temperature=0.9, extra_body={**IDS, "ignore_eos": True})
    r = client.completions.create(**kw).model_dump()
    got = {c["index"]: c for c in r["choices"]}
    assert sorted(got) == [0, 1, 2, 3]
    for p, text in enumerate(prompts):
        for j in range(2):
            assert got[p * 2 + j]["prompt_token_ids"] == served.tm.encode(text)
            assert len(got[p * 2 + j]["token_ids"]) == 6
        native = _native_ids(served, served.tm.encode(text), {
            "max_new_tokens": 6, "n": 2, "seed": 7, "temperature": 0.9, "ignore_eos": True})
        assert native == [got[p * 2]["token_ids"], got[p * 2 + 1]["token_ids"]]
    streamed: dict[int, list[int]] = {}
    firsts: dict[int, Any] = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.model_dump()["choices"]:
            firsts.setdefault(ch["index"], ch.get("prompt_token_ids"))
            if ch["index"] in streamed:
                assert ch.get("prompt_token_ids") is None
            streamed.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
    assert streamed == {i: c["token_ids"] for i, c in got.items()}
    assert firsts == {i: c["prompt_token_ids"] for i, c in got.items()}


def test_tokens_as_token_ids_in_logprobs(client, idle_engine):
    r = client.chat.completions.create(
        model="m", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={**IDS, "return_tokens_as_token_ids": True}).model_dump()
    ch = r["choices"][0]
    assert [e["token"] for e in ch["logprobs"]["content"]] == [
        f"token_id:{t}" for t in ch["token_ids"]]
    for e in ch["logprobs"]["content"]:  # greedy: the chosen token is the top one
        assert [t["token"].startswith("token_id:") for t in e["top_logprobs"]] == [True, True]
        assert e["top_logprobs"][0]["token"] == e["token"]
    c = client.completions.create(model="m", prompt="The sea is", max_tokens=4,
                                  temperature=0, logprobs=1, extra_body={
                                      **IDS, "return_tokens_as_token_ids": True}).model_dump()
    choice = c["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_inference_generate_round_trip(served, idle_engine):
    prompt = served.tm.encode("The sea is")
    sp = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = served.http.post("/inference/v1/generate",
                         json={"model": "m", "token_ids": prompt, "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] and len(out["choices"]) == 1
    ch = out["choices"][0]
    assert ch["index"] == 0 and ch["finish_reason"] == "length"
    native = served.http.post("/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()
    assert ch["token_ids"] == native["output_ids"]
    content = ch["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert [e["logprob"] for e in content] == pytest.approx(
        [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]], abs=1e-6)
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    # streamed: the chunks' ids together are the answer's, the last chunk says why it ended
    events = _sse(served, "/inference/v1/generate", {
        "token_ids": prompt, "sampling_params": sp, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [e for e in events if e["choices"]]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == ch["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert events[-1]["usage"]["prompt_tokens"] == len(prompt)


def test_inference_generate_n_and_request_id(served, idle_engine):
    prompt = served.tm.encode("Mountains are")
    sp = {"max_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0, "ignore_eos": True}
    out = served.http.post("/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": sp, "request_id": "tok-1"}).json()
    assert out["request_id"] == "tok-1"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["token_ids"] for c in out["choices"]] == _native_ids(served, prompt, {
        "max_new_tokens": 5, "n": 2, "seed": 3, "temperature": 1.0, "ignore_eos": True})


@pytest.mark.parametrize("body, param", [
    ({"token_ids": [1, 2], "sampling_params": {"foo": 1}}, "sampling_params.foo"),
    ({"token_ids": [1, 2], "sampling_params": {"temperature": -1}},
     "sampling_params.temperature"),
    ({"token_ids": [1, 2], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
    ({"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": 1}},
     "sampling_params.prompt_logprobs"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": "4"}},
     "sampling_params.max_tokens"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [10**9]}, "token_ids"),
    ({"token_ids": [1, 2], "priority": 1}, "priority"),
    ({"sampling_params": {}}, "token_ids"),
])
def test_inference_generate_bad_values_are_400s(served, body, param):
    r = served.http.post("/inference/v1/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["message"].startswith(param), err


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSGS, "return_token_ids": "yes"}),
    ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": 1}),
])
def test_token_id_flags_must_be_booleans(served, path, body):
    r = served.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "return_token" in r.json()["error"]["message"]
