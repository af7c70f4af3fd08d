"""Request parsing and the mapping onto SamplingParams (no engine needed)."""

from __future__ import annotations

import pytest

from multiserve.server import protocol as P
from multiserve.server import control_bodies as C
from multiserve.server import protocol_native as N
from multiserve import sampling_policy as S
from multiserve.server.errors import ApiError
from multiserve.server.http_utils import parse_body
from multiserve.types import SamplingParamsError


def test_chat_request_parses_and_maps_sampling():
    req = parse_body(P.ChatCompletionRequest, b"""{"model": "m", "messages":
        [{"role": "user", "content": "x", "name": "u"}], "stop": "END", "n": 2,
        "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logprobs": true, "top_logprobs": 4, "max_completion_tokens": 9,
        "unknown_field": {"ignored": true}, "stream_options": {"include_usage": true}}""")
    assert req.max_new_tokens_param == ("max_completion_tokens", 9)
    assert req.include_usage
    sp = P.openai_sampling(req, 9)
    assert sp.stop == ("END",) and sp.n == 2 and sp.temperature == 0 and sp.top_k == 5
    assert sp.seed == 3 and sp.top_logprobs_num == 4 and sp.return_logprob
    assert sp.presence_penalty == 0.5 and sp.repetition_penalty == 1.1


def test_completion_logprobs_int_shape_and_prompt_forms():
    for prompt in ('"text"', '["a", "b"]', "[1, 2, 3]", "[[1], [2, 3]]"):
        req = parse_body(P.CompletionRequest, f'{{"model": "m", "prompt": {prompt}}}'.encode())
        assert req.max_tokens == 16 and not req.echo
    req = parse_body(P.CompletionRequest, b'{"model": "m", "prompt": "x", "logprobs": 3}')
    assert req.top_logprobs_num == 3 and P.openai_sampling(req, 4).return_logprob


@pytest.mark.parametrize("body,param", [
    (b'{"model": "m", "prompt": "x", "max_tokens": 1.5}', "max_tokens"),
    (b'{"model": "m", "prompt": "x", "n": true}', "n"),
    (b'{"model": "m", "prompt": "x", "temperature": "1"}', "temperature"),
    (b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
])
def test_strict_types_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_body(P.CompletionRequest, body)
    assert e.value.status == 400 and e.value.param.split(".")[0] == param


def test_model_may_be_absent_or_any_string():
    """sglang ignores `model` (one model per server): issue 10 item 9."""
    for body in (b'{"prompt": "x"}', b'{"model": "/some/path", "prompt": "x"}'):
        parse_body(P.CompletionRequest, body)
    with pytest.raises(ApiError) as e:
        parse_body(P.CompletionRequest, b'{"model": 5, "prompt": "x"}')
    assert e.value.param == "model"


def test_malformed_json_is_a_400():
    with pytest.raises(ApiError) as e:
        parse_body(P.ChatCompletionRequest, b'{"model": ')
    assert e.value.status == 400 and e.value.code == "invalid_json"


def test_native_sampling_params():
    body = parse_body(N.GenerateRequestBody, b"""{"text": ["a", "b"], "sampling_params":
        {"max_new_tokens": 7, "temperature": 0.5, "stop": "x", "stop_token_ids": [2],
         "n": 3, "json_schema": null}, "return_logprob": true, "top_logprobs_num": 2,
        "token_ids_logprob": [5, 6]}""")
    prompts, is_batch = body.prompts()
    assert prompts == ["a", "b"] and is_batch
    sp = body.sampling(body.sampling_params)
    assert sp.max_new_tokens == 7 and sp.stop == ("x",) and sp.stop_token_ids == (2,)
    assert sp.n == 3 and sp.top_logprobs_num == 2 and sp.token_ids_logprob == (5, 6)
    assert N.GenerateRequestBody(text="a").sampling({}).max_new_tokens == \
        S.DEFAULT_MAX_NEW_TOKENS
    for bad in ({"temperature": -1}, {"top_p": 0}, {"n": 0}, {"stop_token_ids": "x"},
                {"ignore_eos": 1}, {"max_new_tokens": -3}, {"json_schema": "{}"},
                {"logit_bias": {"5": 1.0}}, {"no_such_key": 1}, {"sampling_seed": -1},
                {"stream_interval": 0}):
        b = N.GenerateRequestBody(text="a", sampling_params=bad)
        with pytest.raises(SamplingParamsError) as e:
            b.sampling(bad)
        assert e.value.field == next(iter(bad))


def test_generate_prompt_forms():
    ids = N.GenerateRequestBody(input_ids=[1, 2])
    assert ids.prompts() == ([[1, 2]], False)
    batch = N.GenerateRequestBody(input_ids=[[1], [2, 3]])
    assert batch.prompts() == ([[1], [2, 3]], True)
    with pytest.raises(ValueError):
        N.GenerateRequestBody().prompts()


def test_control_bodies():
    assert parse_body(C.PauseBody, b"", allow_empty=True).mode == "abort"
    assert parse_body(C.PauseBody, b'{"mode": "retract"}').mode == "retract"
    with pytest.raises(ApiError):
        parse_body(C.PauseBody, b'{"mode": "later"}')
    ab = parse_body(C.AbortBody, b'{"abort_all": true}')
    assert ab.abort_all and ab.rid is None


def test_openai_features_we_cannot_honour_are_refused_by_name():
    """sglang's OpenAI extensions that would change the output are refused, never
    ignored; unset (null/false) they are fine, as the router sends them."""
    chat = b'{"messages": [{"role": "user", "content": "x"}], '
    for extra, param in ((b'"input_ids": [1, 2]}', "input_ids"),
                         (b'"custom_logit_processor": "p"}', "custom_logit_processor"),
                         (b'"session_params": {"id": "s"}}', "session_params"),
                         (b'"return_routed_experts": true}', "return_routed_experts"),
                         (b'"logit_bias": {"5": 1.0}}', "logit_bias")):
        assert parse_body(P.ChatCompletionRequest, chat + extra).refused()[0] == param
    assert parse_body(P.ChatCompletionRequest, chat + b'"regex": "a+"}').constraint() == (
        "regex", "regex", "a+")
    ok = parse_body(P.ChatCompletionRequest, chat + b'"return_hidden_states": false, '
                    b'"custom_params": null, "separate_reasoning": true}')
    assert ok.refused() is None
    assert parse_body(P.CompletionRequest, b'{"prompt": "x", "suffix": "y"}').refused()[0] \
        == "suffix"
