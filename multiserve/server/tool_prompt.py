"""The generic tool prompt, for chat templates that never read `tools` (the embedded
default model's, SmolLM2's, is one).

Owns: `tools_as_text(messages, tools)`, which rewrites OpenAI messages so such a template
renders tools, calls and results as plain text in the hermes format (what the `hermes`
parser reads back):
- the tools: a system message (the first one's text, then GENERIC_TOOL_PROMPT with the
  functions as a JSON list inside <tools></tools>), inserted first if there is none;
- an assistant turn's `tool_calls`: its text followed by
  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`;
- a `tool` turn: a `user` turn holding `<tool_response>\\n...\\n</tool_response>`
  (consecutive tool turns share one user turn).

Invariant: messages without calls or tool turns and a request without tools render
exactly as before (the rewrite is the identity on them).
"""

from __future__ import annotations

import json
from typing import Any

# The function-calling system prompt the default model (SmolLM2-Instruct) was trained
# with: a JSON list of calls inside one <tool_call> block (the hermes parser reads both
# that and one object per block).
GENERIC_TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of "
    "possible functions. Based on the question, you will need to make one or more "
    "function/tool calls to achieve the purpose. If none of the functions can be used, "
    "point it out and refuse to answer. If the given question lacks the parameters "
    "required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be "
    "included.\nThe example format is as follows. Please make sure the parameter type is "
    "correct. If no function call is needed, please make the tool calls an empty list "
    "'[]'.\n<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": "
    "{{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n"
    "... (more tool calls as required)\n]</tool_call>")


def tool_calls_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls as the prompt's format asks: one block, a JSON list."""
    listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
              for c in calls]
    return "<tool_call>" + json.dumps(listed, ensure_ascii=False) + "</tool_call>"


def tools_as_text(messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rewrite described in the module docstring (a new list; inputs untouched)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            block = tool_calls_text(m["tool_calls"])
            text = f"{content}\n{block}" if content else block
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        prompt = GENERIC_TOOL_PROMPT.format(tools=listed)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {"role": out[0]["role"],
                      "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
