"""AgentLoop: a multi-turn, tool-using rollout over `/generate` (token ids in and out), as
verl's agent loop and SkyRL run them.

    loop = AgentLoop(url, tokenizer, tools={"add": add}, tool_schemas=[...])
    traj = loop.run([{"role": "user", "content": "What is 2 + 3?"}])
    traj.token_ids, traj.loss_mask, traj.logprobs

One rollout: render the chat (tools included) to ids with the model's template
(`ChatTurns`); then per turn send the ids so far to `/generate` (SGLang's JSON:
`input_ids`, `sampling_params`, `return_logprob`), append the generated ids and their
logprobs, parse tool calls from the generated text (`multiserve.parsing`, as a library),
run the called tools locally (plain Python functions; an exception becomes the tool's
result text "error: ..."), append the tool-result turn's ids, and go on until a turn
calls no tool, `max_turns` model turns ran, or the response budget is spent.

Invariants of the returned `Trajectory`:
- token_ids = prompt_ids + the turns' ids in order (model, tool, model, ...): what a
  final `/generate` would be given, token for token;
- loss_mask[i] = 1 exactly for the tokens a model turn generated, 0 for the prompt and for
  everything the loop wrote (tool-result turns, the closing of a turn the model ended
  without its end-of-turn token, the generation prompts);
- logprobs holds one logprob (the raw distribution's, as `/generate` reports it) per
  generated token, in order: len(logprobs) == sum(loss_mask);
- the response (everything after the prompt) is at most `max_response_tokens` long: a
  model turn's budget is what is left, and a tool turn that does not fit is cut and ends
  the rollout ("length").
Uses only multiserve's HTTP API and the jax-free `multiserve.parsing`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from multiserve.parsing import tool_call_parser
from plugins.rollout.chat_turns import ChatTurns
from plugins.rollout.results import RolloutError

TurnKind = Literal["model", "tool"]
# "stop": a model turn called no tool; "length": the response budget (or a turn's
# max_new_tokens) ran out; "max_turns": the last allowed model turn still called a tool
AgentFinish = Literal["stop", "length", "max_turns"]


@dataclass(frozen=True)
class AgentTurn:
    kind: TurnKind
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()  # model turns: one per id
    text: str = ""  # model turns: the generated text; tool turns: the decoded ids
    finish_reason: str | None = None  # model turns: /generate's finish type


@dataclass(frozen=True)
class Trajectory:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    turns: tuple[AgentTurn, ...]
    messages: tuple[dict[str, Any], ...]  # the chat: given turns, replies, tool results
    finish_reason: AgentFinish

    @property
    def response_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def response_mask(self) -> tuple[int, ...]:
        return self.loss_mask[len(self.prompt_ids):]


class AgentLoop:
    def __init__(self, url: str, tokenizer: Any, tools: Mapping[str, Callable[..., Any]],
                 tool_schemas: Sequence[Mapping[str, Any]], *,
                 tool_call_parser: str = "hermes", max_turns: int = 4,
                 max_response_tokens: int = 1024, max_tokens_per_turn: int = 256,
                 sampling_params: Mapping[str, Any] | None = None,
                 turn_sampling: Callable[[int], Mapping[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 timeout: float = 600.0) -> None:
        """`url`: one engine's HTTP root; `tools`: name -> function called with the call's
        arguments as keywords; `tool_schemas`: the OpenAI tool dicts rendered for the
        model and given to the parser (calls to other names are dropped);
        `sampling_params`: SGLang sampling_params for every turn; `turn_sampling(t)`:
        extra ones for model turn t (0-based), e.g. a `regex` that scripts a turn."""
        if max_turns < 1 or max_response_tokens < 1 or max_tokens_per_turn < 1:
            raise ValueError("max_turns, max_response_tokens and max_tokens_per_turn "
                             "must be >= 1")
        self.url = url.rstrip("/")
        self.tools = dict(tools)
        self.tool_schemas = [dict(t) for t in tool_schemas]
        self.parser = tool_call_parser
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.sampling = dict(sampling_params or {})
        self.turn_sampling = turn_sampling
        self.chat = ChatTurns(tokenizer, self.tool_schemas, chat_template_kwargs)
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentLoop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one rollout -------------------------------------------------------------------
    def run(self, messages: Sequence[Mapping[str, Any]], rid: str | None = None
            ) -> Trajectory:
        chat = [dict(m) for m in messages]
        prompt = self.chat.prompt_ids(chat)
        ids, mask, lps = list(prompt), [0] * len(prompt), []
        turns: list[AgentTurn] = []
        finish: AgentFinish = "max_turns"
        for t in range(self.max_turns):
            left = self.max_response_tokens - (len(ids) - len(prompt))
            if left <= 0:
                finish = "length"
                break
            turn = self._generate(ids, min(self.max_tokens_per_turn, left), t,
                                  None if rid is None else f"{rid}-t{t}")
            turns.append(turn)
            ids += turn.ids
            mask += [1] * len(turn.ids)
            lps += turn.logprobs
            normal, calls = tool_call_parser(self.parser, self.tool_schemas).parse(turn.text)
            reply: dict[str, Any] = {"role": "assistant", "content": normal}
            if calls:
                reply["tool_calls"] = [
                    {"id": f"call_{t}_{i}", "type": "function",
                     "function": {"name": c.name, "arguments": c.parameters}}
                    for i, c in enumerate(calls)]
            chat.append(reply)
            if not calls:
                finish = "length" if turn.finish_reason == "length" else "stop"
                break
            if t == self.max_turns - 1:
                break  # finish stays "max_turns": the call is not run
            results = [{"role": "tool", "tool_call_id": f"call_{t}_{i}", "name": c.name,
                        "content": self._call(c.name, c.parameters)}
                       for i, c in enumerate(calls)]
            chat.extend(results)
            tool_ids = self.chat.tool_turn_ids(turn.ids, results)
            room = self.max_response_tokens - (len(ids) - len(prompt))
            cut = tool_ids[:max(room, 0)]
            turns.append(AgentTurn("tool", tuple(cut),
                                   text=self.chat.tokenizer.decode(cut)))
            ids += cut
            mask += [0] * len(cut)
            if len(cut) < len(tool_ids):
                finish = "length"
                break
        return Trajectory(tuple(prompt), tuple(ids), tuple(mask), tuple(lps), tuple(turns),
                          tuple(chat), finish)

    def _generate(self, ids: Sequence[int], max_new: int, t: int, rid: str | None
                  ) -> AgentTurn:
        sp = {**self.sampling, "max_new_tokens": max_new}
        if self.turn_sampling is not None:
            sp.update(self.turn_sampling(t))
            sp["max_new_tokens"] = min(int(sp["max_new_tokens"]), max_new)
        body: dict[str, Any] = {"input_ids": [int(i) for i in ids], "sampling_params": sp,
                                "return_logprob": True}
        if rid is not None:
            body["rid"] = rid
        r = self._http.post(f"{self.url}/generate", json=body)
        if r.status_code != 200:
            raise RolloutError(f"/generate answered {r.status_code}: {r.text[:500]}")
        out = r.json()
        meta = out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish == "abort":
            raise RolloutError(f"model turn {t} was aborted: "
                               f"{meta['finish_reason'].get('message')}")
        gen = tuple(int(i) for i in out["output_ids"])
        lps = tuple(float(x[0]) for x in meta["output_token_logprobs"])
        if len(lps) != len(gen):
            raise RolloutError(f"/generate gave {len(lps)} logprobs for {len(gen)} tokens")
        return AgentTurn("model", gen, lps, out["text"], finish)

    def _call(self, name: str, parameters: str) -> str:
        """Run one tool; its result as the tool turn's text (str as is, else JSON)."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: no tool named {name!r}"
        try:
            result = fn(**json.loads(parameters))
        except Exception as exc:  # noqa: BLE001 - the model sees its tool's failure
            return f"error: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
