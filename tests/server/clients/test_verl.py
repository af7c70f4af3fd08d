"""verl (volcengine/verl) against an engine port, unchanged: its HTTP server adapter
(verl/workers/rollout/sglang_rollout/http_server_engine.py: generate, flush_cache, memory
release/resume, abort_request), its batch-level rollout call (sglang_rollout.py: every
prompt in one /generate, `image_data` one null per prompt), its logprob extraction from
`input_token_logprobs[1:]`, and its offline chat generation
(verl/trainer/main_generation_server.py: /v1/chat/completions with the model's path).

Issue 10 items shown here: 3 (memory tags), 8 (teacher scoring: max_new_tokens 0 with
input logprobs, bitwise equal to the generation's), 9 (any `model` string).
"""

from __future__ import annotations

from typing import Any

from client_helpers import Live
from openai.types.chat import ChatCompletion

PROMPTS = [[1, 9, 402, 1771, 33, 5], [1, 640, 15, 8811, 2049, 300, 41, 7], [1, 28, 3]]


def adapter_generate(live: Live, **kwargs: Any) -> Any:
    """AsyncHttpServerAdapter.generate: the payload without its None values."""
    payload = {"text": kwargs.get("prompt"), "sampling_params": kwargs.get("sampling_params"),
               "input_ids": kwargs.get("input_ids"), "image_data": kwargs.get("image_data"),
               "return_logprob": kwargs.get("return_logprob", False),
               "logprob_start_len": kwargs.get("logprob_start_len"),
               "top_logprobs_num": kwargs.get("top_logprobs_num"),
               "token_ids_logprob": kwargs.get("token_ids_logprob"),
               "lora_path": kwargs.get("lora_path"),
               "custom_logit_processor": kwargs.get("custom_logit_processor")}
    r = live.http.post(f"{live.url}/generate",
                       json={k: v for k, v in payload.items() if v is not None})
    assert r.status_code == 200, r.text
    return r.json()


def rollout_sampling(response_length: int, do_sample: bool = True) -> dict[str, Any]:
    """SGLangRollout._init_sampling_params (config keys that are SamplingParams fields),
    and the do_sample=False overrides of _batch_level_generate_sequences."""
    params: dict[str, Any] = dict(n=1, max_new_tokens=response_length, presence_penalty=0.0,
                                  frequency_penalty=0.0, repetition_penalty=1.0,
                                  temperature=1.0, top_k=-1, top_p=1.0, ignore_eos=False)
    if not do_sample:
        params.update({"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                       "repetition_penalty": 1.0, "temperature": 0, "top_p": 1, "top_k": -1,
                       "ignore_eos": False, "min_new_tokens": 0,
                       "max_new_tokens": response_length, "skip_special_tokens": True,
                       "spaces_between_special_tokens": True})
    return params


def post_process(outputs: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
    """_post_process_outputs: (token ids, logprobs) from output_token_logprobs."""
    out = []
    for resp in outputs:
        triples = resp["meta_info"]["output_token_logprobs"]
        lps, ids = zip(*[(lp, tid) for lp, tid, _ in triples], strict=True)
        out.append((list(ids), list(lps)))
    return out


def test_batch_level_rollout(live: Live) -> None:
    """All prompts in one request, image_data [null, ...], sampled and greedy."""
    for do_sample in (True, False):
        outputs = adapter_generate(live, sampling_params=rollout_sampling(10, do_sample),
                                   return_logprob=True, input_ids=PROMPTS,
                                   image_data=[None] * len(PROMPTS))
        assert isinstance(outputs, list) and len(outputs) == len(PROMPTS)
        for (ids, lps), resp in zip(post_process(outputs), outputs, strict=True):
            assert ids == resp["output_ids"] and len(ids) <= 10
            assert all(lp <= 0.0 for lp in lps)
    # greedy: each prompt's answer is the one it gets alone
    alone = [adapter_generate(live, sampling_params=rollout_sampling(10, False),
                              return_logprob=True, input_ids=p) for p in PROMPTS]
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in alone]
    # a real image is refused by name, never ignored
    r = live.http.post(f"{live.url}/generate", json={
        "input_ids": PROMPTS, "image_data": [None, "cat.png", None],
        "sampling_params": rollout_sampling(4)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"


def test_teacher_scoring_matches_generation_logprobs_bitwise(live: Live) -> None:
    """Item 8: {"input_ids": prompt+response, "sampling_params": {"max_new_tokens": 0},
    "return_logprob": true, "logprob_start_len": 0} -> one input_token_logprobs entry
    per input position (the first null), no generated token; the response positions
    carry exactly the logprobs those tokens had when they were generated."""
    for seed in (None, 11):  # greedy, and a seeded sampled generation
        sp = rollout_sampling(24, do_sample=seed is not None)
        if seed is not None:
            sp["seed"] = seed
        prompt = PROMPTS[1]
        gen = adapter_generate(live, sampling_params=sp, return_logprob=True,
                               input_ids=prompt)
        (resp_ids, resp_lps), = post_process([gen])
        scored = adapter_generate(live, input_ids=prompt + resp_ids,
                                  sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=0)
        meta = scored["meta_info"]
        assert scored["output_ids"] == [] and meta["completion_tokens"] == 0
        assert meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(prompt) + len(resp_ids)
        assert entries[0][0] is None and entries[0][1] == prompt[0]
        assert [e[1] for e in entries] == prompt + resp_ids
        # verl's _extract_logprob_from_output: input_token_logprobs[1:]
        lps, ids = zip(*[(lp, tid) for lp, tid, _ in entries[1:]], strict=False)
        assert list(ids) == (prompt + resp_ids)[1:]
        assert list(lps[len(prompt) - 1:]) == resp_lps  # bitwise: same floats
        assert all(isinstance(x, float) for x in lps)


def test_adapter_control_calls(live: Live) -> None:
    """Item 3: verl's tags ["kv_cache", "weights"] and None; flush_cache via GET;
    abort_request with verl's defaults {"rid": "", "abort_all": false}."""
    h, url = live.http, live.url
    assert h.get(f"{url}/flush_cache").status_code == 200
    r = h.post(f"{url}/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert h.get(f"{url}/health").json()["status"] == "asleep"
    r = h.post(f"{url}/resume_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    r = h.post(f"{url}/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and set(live.state()["memory_released"]) == \
        {"weights", "kv_cache"}
    r = h.post(f"{url}/resume_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and live.state()["memory_released"] == []
    for body in ({"rid": "", "abort_all": False}, {"rid": "", "abort_all": True}):
        r = h.post(f"{url}/abort_request", json=body)
        assert r.status_code == 200 and r.json()["success"] is True
    models = h.get(f"{url}/v1/models").json()  # available_models
    assert [m["id"] for m in models["data"]] == [live.model_name]


def test_offline_chat_generation_with_the_model_path(live: Live) -> None:
    """Item 9: main_generation_server.submit_request: the model's path as `model`, a
    Bearer token the server does not ask for, parsed as openai's ChatCompletion."""
    h = live.http
    messages = [{"role": "user", "content": "What is two plus two?"}]
    for url in live.urls[:2]:  # verl splits the prompts over the replicas
        r = h.post(f"{url}/v1/chat/completions",
                   headers={"Authorization": "Bearer token-abc123"},
                   json={"model": str(live.base), "messages": messages,
                         "temperature": 1.0, "top_p": 1.0, "max_tokens": 8})
        assert r.status_code == 200, r.text
        completion = ChatCompletion(**r.json())
        assert isinstance(completion.choices[0].message.content, str)
        assert completion.model == live.model_name  # the served model is named
    for model in ("gpt-4", "", "/some/other/path"):
        r = h.post(f"{live.url}/v1/completions",
                   json={"model": model, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, (model, r.text)
    r = h.post(f"{live.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text  # no model at all: sglang's default, the served one
