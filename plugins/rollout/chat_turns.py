"""A chat's turns as token ids, rendered by the model's own chat template: what an agentic
rollout appends between model turns.

Owns `ChatTurns`:
  prompt_ids(messages)            the first prompt: the chat so far, tools included
                                  (`apply_chat_template(..., tools=...)`), ending with the
                                  generation prompt
  tool_turn_ids(model_ids, tool_messages)
                                  the tokens that follow a model turn which called tools:
                                  the rest of the assistant turn's closing (what the template
                                  writes after the reply, minus the end-of-turn token the
                                  model emitted itself), the tool-result turn, and the next
                                  generation prompt

Invariants:
- The tool-result turn is the template's own rendering: the text the template adds to a
  chat when the tool messages are appended (rendered after a fixed probe conversation; the
  probe's text is a prefix of the longer one, checked), so its tokens are exactly what
  the template would write there; the closing is what it writes after an assistant reply.
- A template that never reads `tools` (the embedded default model's) gets the tools, the
  history calls and tool turns as the server's generic tool prompt writes them
  (`multiserve.server.tool_prompt`, jax-free), so a rollout renders what
  `/v1/chat/completions` would.
- Text is tokenized without added special tokens (the template writes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A reply no template rewrites, so what follows its last occurrence is the turn's closing.
_PROBE_REPLY = "ROLLOUT-PROBE-REPLY"
_PROBE = ({"role": "user", "content": "ROLLOUT-PROBE-QUESTION"},
          {"role": "assistant", "content": _PROBE_REPLY})


class ChatTurns:
    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        """`tokenizer`: an HF tokenizer with a chat template; `tools`: OpenAI tool dicts."""
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else []
        self.kwargs = dict(chat_template_kwargs or {})
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ValueError("the tokenizer has no chat template")
        self.template_reads_tools = "tools" in template
        self._probe = self.render(_PROBE, add_generation_prompt=False, with_tools=False)
        # what the template writes after an assistant reply (e.g. "<|im_end|>\n")
        self.closing = self._probe[self._probe.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        closing_ids = self.encode(self.closing)
        eot = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        if closing_ids and closing_ids[0] in set(tokenizer.all_special_ids):
            eot.add(closing_ids[0])
        # tokens that end a model turn: EOS and the closing's first special token
        self.end_of_turn_ids = frozenset(eot)

    # ---- rendering -----------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               with_tools: bool = True) -> str:
        msgs = [dict(m) for m in messages]
        kw = dict(self.kwargs)
        tools = self.tools if with_tools else []
        if self.template_reads_tools:
            if tools:
                kw["tools"] = tools
        elif tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in msgs):
            from multiserve.server.tool_prompt import tools_as_text

            msgs = tools_as_text(msgs, tools)
        return self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    # ---- turns -----------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def tool_turn_ids(self, model_ids: Sequence[int],
                      tool_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens after a model turn (`model_ids`) that called tools, up to and
        including the next generation prompt; `tool_messages`: the `role: "tool"` turns."""
        # the tools are left out of the probe: the tool turn's text does not depend on
        # them, and the generic prompt's system turn would only lengthen both renderings
        after = self.render([*_PROBE, *tool_messages], add_generation_prompt=True,
                            with_tools=False)
        if not after.startswith(self._probe):
            raise ValueError("the chat template rewrites earlier turns when tool turns "
                             "follow; the tool turn's tokens cannot be derived")
        ids = self.encode(self.closing + after[len(self._probe):])
        if model_ids and ids and int(model_ids[-1]) == ids[0] and \
                ids[0] in self.end_of_turn_ids:
            ids = ids[1:]  # the model wrote the end-of-turn token itself
        return ids
