"""Structured outputs on the default model (SmolLM2-135M-Instruct) through real clients:
the official openai client's `chat.completions.parse(response_format=PydanticModel)`,
`response_format` json_object, and the exact JSON SGLang clients send to /generate with
json_schema (a string), regex and ebnf. Greedy; every reply must parse / match."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture
def url(default_server_url: str) -> str:
    return default_server_url


def test_openai_parse_with_a_pydantic_model(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    r = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=160, temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, City), msg.content
    assert r.choices[0].finish_reason == "stop"


def test_json_object(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=64, temperature=0)
    text = r.choices[0].message.content or ""
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # length: still a prefix of a JSON object
        assert text.lstrip().startswith("{"), text


def test_sglang_generate_constraints(url: str) -> None:
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}},
                         "required": ["answer"], "additionalProperties": False})
    cases = [("json_schema", schema, lambda t: set(json.loads(t)) == {"answer"}),
             ("regex", r"(yes|no), because [a-z ]{1,40}\.",
              lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", t) is not None),
             ("ebnf", 'root ::= "The answer is " digit+ "."\ndigit ::= [0-9]',
              lambda t: re.fullmatch(r"The answer is [0-9]+\.", t) is not None)]
    for key, spec, ok in cases:
        body = {"text": "Question: is 2 + 2 = 4? Answer:", "sampling_params": {
            "temperature": 0, "max_new_tokens": 64, key: spec}, "return_logprob": True}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (key, out["text"])
        assert ok(out["text"]), (key, out["text"])
        # logprobs are the model's raw ones, one per emitted token
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_the_readme_curl_and_openai_examples(url: str) -> None:
    """README "First requests": its curl and openai-client examples, verbatim but for the
    address (the fleet's engine port 31000 and front door 30000 there; the suite's
    default-model server here: the same routes and model name)."""
    import contextlib
    import io
    import shutil
    import subprocess

    from readme_examples import readme_block

    host = url.removeprefix("http://")
    if shutil.which("curl") is not None:
        curl = readme_block("bash", "localhost:31000/v1/chat/completions")
        assert curl.count("localhost:31000") == 1
        done = subprocess.run(["bash", "-c", curl.replace("localhost:31000", host)],
                              capture_output=True, text=True, timeout=120, check=True)
        reply = json.loads(done.stdout)
        assert reply["choices"][0]["message"]["content"].strip()
    code = readme_block("python", "from openai import OpenAI")
    assert code.count("http://127.0.0.1:30000") == 1
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace("http://127.0.0.1:30000", url), "README.md", "exec"),
             namespace)
    assert printed.getvalue().strip() == namespace["r"].choices[0].message.content.strip() != ""
