"""The official openai client (sync and async) against a real server + real engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]
NO_EOS = {"ignore_eos": True}


def _together(*calls):
    """Run zero-argument callables concurrently (the engine batches them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _prompt_len(hf_tok, messages) -> int:
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(out["input_ids"] if hasattr(out, "keys") else out)


def test_models_lists_the_served_model(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [served.engine.model_name]


def test_chat_non_streaming_usage_and_logprobs(client, served, hf_tok, idle_engine):
    model = served.engine.model_name
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body=NO_EOS)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant"
    assert r.usage.prompt_tokens == _prompt_len(hf_tok, MSGS)
    assert r.usage.completion_tokens == 8 == len(ch.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # Greedy: the chosen token is the best of the top logprobs; bytes rebuild the text.
    for tok in ch.logprobs.content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-5)
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
        assert tok.logprob <= 0
    special = set(hf_tok.all_special_tokens)
    raw = b"".join(bytes(t.bytes) for t in ch.logprobs.content if t.token not in special)
    assert raw.decode("utf-8", errors="replace") == ch.message.content


def test_chat_stream_matches_non_stream_with_usage(client, served, idle_engine):
    model = served.engine.model_name
    full, chunks = _together(
        lambda: client.chat.completions.create(model=model, messages=MSGS, max_tokens=10,
                                               temperature=0),
        lambda: list(client.chat.completions.create(
            model=model, messages=MSGS, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True})))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n2_echo_and_logprobs(client, served, hf_tok, idle_engine):
    model = served.engine.model_name
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=2,
                                  temperature=0.9, seed=7, logprobs=2, echo=True,
                                  extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    n_prompt = len(hf_tok.encode(prompt))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 12
    for c in r.choices:
        assert c.text.startswith(prompt) and c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 6
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[n_prompt:])
        assert all(len(t) == 2 for t in lp.top_logprobs[n_prompt:])
        assert lp.text_offset == sorted(lp.text_offset)
        # echo + logprobs: the prompt is scored too (its first token has no context)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:n_prompt])
        assert all(len(t) == 2 for t in lp.top_logprobs[1:n_prompt])
    # the prompt's logprobs do not depend on the sample
    a, b = (c.logprobs.token_logprobs[:n_prompt] for c in r.choices)
    assert a == b


def test_completions_batch_prompts_and_streaming(client, served, idle_engine):
    model = served.engine.model_name
    prompts = ["One, two, three,", "Red, green,"]

    def streamed(p: str) -> str:
        return "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=p, max_tokens=5, temperature=0, stream=True,
            extra_body=NO_EOS) if c.choices)

    r, *singles = _together(
        lambda: client.completions.create(model=model, prompt=prompts, max_tokens=5,
                                          temperature=0, extra_body=NO_EOS),
        *[lambda p=p: streamed(p) for p in prompts])
    by_index = {c.index: c.text for c in r.choices}
    assert set(by_index) == {0, 1}
    assert singles == [by_index[0], by_index[1]]


def test_stop_strings_trim_and_report(client, served, idle_engine):
    model = served.engine.model_name
    base = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=16,
                                     temperature=0, extra_body=NO_EOS)
    text = base.choices[0].text
    assert len(text) > 6, text
    stop = text[3:6]  # a string the greedy continuation certainly contains

    def streamed():
        chunks = list(client.completions.create(
            model=model, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0,
            stop=[stop, "never-seen"], stream=True, extra_body=NO_EOS))
        return ("".join(c.choices[0].text for c in chunks if c.choices),
                [c.choices[0].finish_reason for c in chunks if c.choices][-1], None)

    def whole():
        r = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=16,
                                      temperature=0, stop=stop, extra_body=NO_EOS)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    for got, reason, used in _together(streamed, whole):
        assert got == text[:text.find(stop)]
        assert reason == "stop"
        assert used is None or used < 16


def test_seed_reproducibility(client, served, idle_engine):
    model = served.engine.model_name
    kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=12, temperature=2.0, extra_body={**NO_EOS, "top_k": 50})
    a, b, c = _together(lambda: client.chat.completions.create(seed=1234, **kw),
                        lambda: client.chat.completions.create(seed=1234, **kw),
                        lambda: client.chat.completions.create(seed=99, **kw))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


async def test_async_client_concurrent_chat_stream_n2(served, idle_engine):
    model = served.engine.model_name
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none",
                                  max_retries=0) as ac:
        async def one(i: int):
            stream = await ac.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=8, temperature=0.7, seed=i, n=2, stream=True,
                stream_options={"include_usage": True}, extra_body=NO_EOS)
            texts, finish, usage = {0: "", 1: ""}, {}, None
            async for ch in stream:
                for c in ch.choices:
                    texts[c.index] += c.delta.content or ""
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
                if ch.usage:
                    usage = ch.usage
            return texts, finish, usage

        results = await asyncio.gather(*(one(i) for i in range(4)))
        for _texts, finish, usage in results:
            assert finish == {0: "length", 1: "length"}
            assert usage.completion_tokens == 16
        # The non-streaming async path gives the same sampled text for the same seed.
        r = await ac.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to 3."}], max_tokens=8,
            temperature=0.7, seed=0, n=2, extra_body=NO_EOS)
        assert {c.index: c.message.content for c in r.choices} == results[0][0]
