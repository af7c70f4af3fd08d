"""Tool-call and reasoning parsers for model outputs, on text or token ids; plain Python (no jax, no
torch), usable as a library by RL callers and by the server.

    from multiserve.parsing import tool_call_parser, reasoning_parser
    normal, calls = tool_call_parser("hermes", tools).parse(text)
    reasoning, answer = reasoning_parser("qwen3").parse(text)

Streaming: `p = tool_call_parser(name, tools)`; `p.feed(delta)` for each text delta and
`p.flush()` at the end, each returning normal text and `ToolCallDelta`s.

On token ids (decoded by the caller's tokenizer): `parse_tool_call_ids(ids, tokenizer,
name, tools)`, `separate_reasoning_ids(ids, tokenizer, name)`, and `IncrementalDecoder`
for streams (token_ids.py).
"""

from multiserve.parsing.base import ToolCallParser
from multiserve.parsing.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser
from multiserve.parsing.registry import (
    TOOL_PARSERS,
    detect_tool_call_parser,
    tool_call_parser,
)
from multiserve.parsing.token_ids import (
    IncrementalDecoder,
    parse_tool_call_ids,
    separate_reasoning_ids,
)
from multiserve.parsing.types import ToolCall, ToolCallDelta, ToolStreamResult

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "IncrementalDecoder", "ReasoningParser",
           "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolStreamResult",
           "detect_tool_call_parser", "parse_tool_call_ids", "reasoning_parser",
           "separate_reasoning_ids", "tool_call_parser"]
