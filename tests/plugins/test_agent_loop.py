"""The agentic rollout (plugins/rollout/agent_loop.py) against a real server on loopback.

The tiny random model (the default model's tokenizer and chat template, 2 layers) cannot
choose to call a tool, so the test scripts its turns through `/generate`'s SGLang
`regex` sampling param: turn 0 is forced to a hermes `<tool_call>` block, turn 1 to a
plain answer. What is checked is the bookkeeping, exactly: the ids are the prompt and the
turns concatenated, the loss mask is 1 on generated tokens only, one logprob per
generated token, the tool ran with the call's arguments and its result is in the tool
turn, and the tool turn is the chat template's own rendering.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loopback_server import engine_server
from shipped_engine import SHIPPED_FUSED_STEP_MAX

from plugins.rollout import AgentLoop, ChatTurns, RolloutError, Trajectory

ENGINE_KW: dict[str, Any] = dict(
    max_running_requests=8, precompile_bs_paddings=(8,), precompile_token_paddings=(64, 256),
    chunked_prefill_size=256, max_total_tokens=4096, max_context_len=2048,
    show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL = re.escape('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
ANSWER = r"The sum is [0-9]{1,2}\."
QUESTION = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from transformers import AutoTokenizer

    from multiserve import Engine
    from multiserve.config import EngineConfig
    from multiserve.reliability.tiny_model import write_tiny_model

    model: Path = write_tiny_model(tmp_path_factory.mktemp("tiny-agent"))
    engine = Engine(EngineConfig(model_path=str(model), **ENGINE_KW))
    with engine_server(engine) as url:
        yield url, AutoTokenizer.from_pretrained(str(engine.tokenizer_dir))
    engine.shutdown()


def _scripted(script: list[str]) -> Any:
    return lambda t: {"regex": script[min(t, len(script) - 1)]}


def _check_bookkeeping(traj: Trajectory) -> None:
    ids = list(traj.prompt_ids)
    mask = [0] * len(ids)
    for turn in traj.turns:
        ids += turn.ids
        mask += [1 if turn.kind == "model" else 0] * len(turn.ids)
    assert traj.token_ids == tuple(ids)
    assert traj.loss_mask == tuple(mask)
    generated = [lp for t in traj.turns if t.kind == "model" for lp in t.logprobs]
    assert traj.logprobs == tuple(generated)
    assert len(traj.logprobs) == sum(traj.loss_mask)
    assert all(math.isfinite(lp) and lp <= 0 for lp in traj.logprobs)
    for t in traj.turns:
        if t.kind == "model":
            assert len(t.logprobs) == len(t.ids) > 0


def test_scripted_tool_call_rollout(server: tuple[str, Any]) -> None:
    url, tok = server
    seen: list[dict[str, int]] = []

    def add(a: int, b: int) -> int:
        seen.append({"a": a, "b": b})
        return a + b

    with AgentLoop(url, tok, {"add": add}, [ADD], max_turns=4, max_response_tokens=400,
                   max_tokens_per_turn=64, sampling_params={"temperature": 0.0},
                   turn_sampling=_scripted([CALL, ANSWER])) as loop:
        traj = loop.run(QUESTION, rid="agent")
        again = loop.run(QUESTION)
    assert seen == [{"a": 2, "b": 3}, {"a": 2, "b": 3}]
    assert [t.kind for t in traj.turns] == ["model", "tool", "model"]
    assert traj.finish_reason == "stop"
    _check_bookkeeping(traj)
    chat = ChatTurns(tok, [ADD])
    # the prompt is the template's rendering (the default model's template ignores tools:
    # the generic tool prompt carries them), tokenized without added specials
    assert list(traj.prompt_ids) == chat.prompt_ids(QUESTION)
    assert '"name": "add"' in tok.decode(traj.prompt_ids)
    call, tool, answer = traj.turns
    assert "<tool_call>" in call.text and call.finish_reason == "stop"
    assert re.fullmatch(ANSWER, answer.text)
    # the tool turn: the closing of the model's turn, the result turn, the generation prompt
    assert list(tool.ids) == chat.tool_turn_ids(call.ids, [traj.messages[2]])
    assert "<tool_response>" in tool.text and "5" in tool.text
    # (the default model's template is ChatML; the forced call ends without <|im_end|>)
    assert chat.closing == "<|im_end|>\n" and tool.text.startswith(chat.closing)
    assert tool.text.endswith("<|im_start|>assistant\n")
    assert traj.messages[1]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert traj.messages[2] == {"role": "tool", "tool_call_id": "call_0_0", "name": "add",
                                "content": "5"}
    # greedy: the same rollout again gives the same trajectory, bit for bit
    assert (again.token_ids, again.loss_mask, again.logprobs) == (
        traj.token_ids, traj.loss_mask, traj.logprobs)


def test_budgets_end_the_rollout(server: tuple[str, Any]) -> None:
    url, tok = server

    def boom(a: int, b: int) -> int:
        raise ValueError("no adding today")

    # every turn calls the tool: max_turns ends it, the last call is not run
    with AgentLoop(url, tok, {"add": boom}, [ADD], max_turns=2, max_response_tokens=400,
                   sampling_params={"temperature": 0.0},
                   turn_sampling=_scripted([CALL])) as loop:
        traj = loop.run(QUESTION)
    assert traj.finish_reason == "max_turns"
    assert [t.kind for t in traj.turns] == ["model", "tool", "model"]
    assert traj.messages[2]["content"] == "error: ValueError: no adding today"
    _check_bookkeeping(traj)
    # a response budget smaller than two calls: the tool turn or the next model turn is cut
    budget = len(traj.turns[0].ids) + 5
    with AgentLoop(url, tok, {"add": boom}, [ADD], max_turns=4, max_response_tokens=budget,
                   sampling_params={"temperature": 0.0},
                   turn_sampling=_scripted([CALL])) as loop:
        short = loop.run(QUESTION)
    assert short.finish_reason == "length"
    assert len(short.response_ids) == budget
    _check_bookkeeping(short)
    assert short.turns[1].ids == traj.turns[1].ids[:5]


def test_a_refused_turn_is_an_error(server: tuple[str, Any]) -> None:
    url, tok = server
    with AgentLoop(url, tok, {}, [ADD], turn_sampling=lambda t: {"regex": "("}) as loop, \
            pytest.raises(RolloutError, match="/generate answered 400"):
        loop.run(QUESTION)


def test_a_turn_the_model_ended_itself_keeps_its_end_token_once() -> None:
    """After a reply that ends with the end-of-turn token the tool turn starts with the
    rest of the closing only; after one cut short (a grammar or stop string) with all of it."""
    from transformers import AutoTokenizer

    from multiserve.model.loading.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    chat = ChatTurns(tok, [ADD])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in chat.end_of_turn_ids
    result = [{"role": "tool", "tool_call_id": "c", "name": "add", "content": "5"}]
    cut_short = chat.tool_turn_ids([11, 12], result)
    ended = chat.tool_turn_ids([11, 12, end], result)
    assert cut_short[0] == end and ended == cut_short[1:]
    full = tok.decode([11, 12, end] + ended)
    assert full.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
