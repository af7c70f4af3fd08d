"""Prefix-cache isolation over HTTP (issue 63 item 2): vLLM's `cache_salt` and SGLang's
`extra_key` on chat, completions, /generate and /inference/v1/generate. Requests with
different keys never share cached pages, the same key shares, the answer's bits are the
same with or without a hit, and the hit is reported where vLLM and SGLang report it
(usage.prompt_tokens_details.cached_tokens, meta_info.cached_tokens)."""

from __future__ import annotations

from typing import Any

import pytest

LONG = ("Tell me, in order, the names of every planet of the solar system, then the "
        "largest moon of each, then one fact about each moon. ")


# A system prompt of this file's own: without one the chat template puts its default
# system prompt first, whose first page any unsalted chat of another test on the shared
# engine may already have cached, so the unsalted request here could hit it.
SYSTEM = "Cache-isolation probe: answer plainly."


def _chat(client: Any, model: str, text: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": text}], max_tokens=8,
        temperature=0, logprobs=True, extra_body=extra or None)


def _bits(choice: Any) -> tuple:
    return choice.message.content, tuple(t.logprob for t in choice.logprobs.content)


def test_chat_cache_salt_with_the_openai_client(client: Any, idle_engine: Any) -> None:
    """What SkyRL's Harbor generator sends (extra_body cache_salt): keyed by version."""
    model, text = idle_engine.engine.model_name, LONG + "(chat)"
    first = _chat(client, model, text, cache_salt="v1")
    same = _chat(client, model, text, cache_salt="v1")
    other = _chat(client, model, text, cache_salt="v2")
    plain = _chat(client, model, text)
    sglang = _chat(client, model, text, extra_key="v1")  # SGLang's field: another namespace
    hits = [r.usage.prompt_tokens_details.cached_tokens for r in (first, same, other, plain,
                                                                  sglang)]
    assert hits[0] == 0 and hits[1] > 0 and hits[2:] == [0, 0, 0], hits
    assert len({_bits(r.choices[0]) for r in (first, same, other, plain, sglang)}) == 1


def test_completions_salt_and_extra_key(idle_engine: Any) -> None:
    h, model = idle_engine.http, idle_engine.engine.model_name
    body = {"model": model, "prompt": LONG + "(completions)", "max_tokens": 6,
            "temperature": 0, "logprobs": 0}
    runs = [h.post("/v1/completions", json={**body, **keys}).json() for keys in (
        {"cache_salt": "t1", "extra_key": "a"}, {"cache_salt": "t1", "extra_key": "a"},
        {"cache_salt": "t1"}, {"cache_salt": "t1", "extra_key": "b"})]
    hits = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in runs]
    assert hits[0] == 0 and hits[1] > 0 and hits[2:] == [0, 0], hits
    assert len({(r["choices"][0]["text"], tuple(r["choices"][0]["logprobs"]["token_logprobs"]))
                for r in runs}) == 1


def test_generate_extra_key_one_or_per_prompt(idle_engine: Any) -> None:
    h = idle_engine.http
    ids = list(range(400, 460))
    sp = {"max_new_tokens": 6, "temperature": 0}

    def gen(**kw: Any) -> Any:
        r = h.post("/generate", json={"input_ids": ids, "sampling_params": sp,
                                      "return_logprob": True, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    a, b, c, plain = gen(extra_key="k"), gen(extra_key="k"), gen(extra_key="j"), gen()
    hits = [x["meta_info"]["cached_tokens"] for x in (a, b, c, plain)]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0 and hits[3] == 0, hits
    assert len({tuple(x["output_ids"]) for x in (a, b, c, plain)}) == 1
    both = h.post("/generate", json={"input_ids": [ids, ids], "sampling_params": sp,
                                     "extra_key": ["k", "fresh"]}).json()
    assert [x["meta_info"]["cached_tokens"] for x in both] == [hits[1], 0]


def test_tokens_endpoint_cache_salt(idle_engine: Any) -> None:
    """SkyRL's /inference/v1/generate body with its top-level cache_salt."""
    h = idle_engine.http
    body = {"token_ids": list(range(600, 660)), "model": "m",
            "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 0}}
    runs = [h.post("/inference/v1/generate", json={**body, **k}).json()
            for k in ({"cache_salt": "w3"}, {"cache_salt": "w3"}, {"cache_salt": "w4"})]
    hits = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in runs]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0, hits
    assert len({tuple(r["choices"][0]["token_ids"]) for r in runs}) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "cache_salt": 5}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "extra_key": ["a"]}, "extra_key"),
    ("/generate", {"input_ids": [[1, 2], [3, 4]], "extra_key": ["a"]}, "extra_key"),
    ("/generate", {"input_ids": [1, 2], "extra_key": 3}, "extra_key"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "cache_salt": ""}, "cache_salt"),
])
def test_bad_keys_are_400_naming_the_field(idle_engine: Any, path: str, body: dict,
                                           param: str) -> None:
    r = idle_engine.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") or param in err["message"], err
