"""The official openai client with `tools` against a real server on the default model
(SmolLM2-135M-Instruct, whose template ignores tools: the generic tool prompt,
server/tool_prompt.py, and the hermes parser). Greedy, so the replies are fixed; the
assertions hold for any reply of the right shape except where a call is expected: after a
few-shot history of calls the model writes one (without grammar enforcement a 135M model
rarely calls a tool on a first turn)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _call(cid: str, city: str) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


# A few-shot history: a call answered by a tool turn and the model's answer, then two
# more questions answered with calls, then a new city.
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "Paris")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "assistant", "content": "It is 22 C and sunny in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_2", "Rome")]},
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_3", "Berlin")]},
    {"role": "user", "content": "What is the weather in London?"},
]


@pytest.fixture(scope="module")
def default_server(default_server_url: str) -> str:
    return default_server_url


@pytest.fixture(scope="module")
def client(default_server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=default_server + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    content, calls, finish = "", {}, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # a call's first delta: id and name
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_tool_call_after_a_tool_result_turn(client):
    kw = dict(model="m", messages=HISTORY, tools=[WEATHER], max_tokens=48, temperature=0)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "London"}
    assert "<tool_call>" not in (ch.message.content or "")
    # streamed: the same calls and text, nothing of the call in the content
    content, calls, finish = _stream(client, **kw)
    assert finish == "tool_calls" and content == (ch.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(call.function.name, call.function.arguments)]


def test_auto_first_turn_and_parallel_false(client):
    """Whatever the model answers on a first turn, the reply is well formed, and the
    stream gives what the non-streamed reply gives."""
    kw = dict(model="m", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
              tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, max_tokens=32,
              temperature=0)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    assert len(calls) <= 1
    assert (ch.finish_reason == "tool_calls") == bool(calls)
    content, streamed, _ = _stream(client, **kw)
    assert content == (ch.message.content or "")
    assert [c["name"] for c in streamed.values()] == [c.function.name for c in calls]


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"]}}}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_choices_are_enforced(client, choice, parallel):
    """On a FIRST turn (where the 135M model, unconstrained, rarely calls), the grammar
    makes the reply a call whose arguments validate against the tool's schema. A named
    function is exactly one call whatever parallel_tool_calls says (as SGLang and vLLM);
    `required` is one call with parallel_tool_calls false, one or more with true."""
    import jsonschema_rs

    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_time"}}
    kw: dict[str, Any] = dict(
        model="m", messages=[{"role": "user", "content": "Hello! Tell me a joke."}],
        tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=parallel,
        max_tokens=96, temperature=0)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls
    assert calls is not None and len(calls) >= 1
    if choice == "named" or not parallel:
        assert len(calls) == 1, [c.function.name for c in calls]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        if choice == "named":
            assert call.function.name == "get_time"
        jsonschema_rs.validate(schema[call.function.name], json.loads(call.function.arguments))
    if choice == "named":  # streamed: the same single call
        _, streamed, finish = _stream(client, **kw)
        assert finish == "tool_calls"
        assert [c["name"] for c in streamed.values()] == ["get_time"]
        assert streamed[0]["arguments"] == calls[0].function.arguments
