"""SGLang's parser endpoints on an engine server (no engine involved: text in, text out).

- POST /parse_function_call: `{"text", "tool_call_parser", "tools"}` ->
  `{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}` (`tool_index`: the
  tool's position in `tools`; `parameters`: JSON text; calls to tools not listed are
  dropped, as SGLang does).
- POST /separate_reasoning: `{"text", "reasoning_parser"}` -> `{"text", "reasoning_text"}`.

Invariant: an unknown parser name is a 400 naming the known ones, never a 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.parsing import REASONING_PARSERS, TOOL_PARSERS, reasoning_parser, tool_call_parser
from multiserve.server.errors import bad_request
from multiserve.server.http_utils import parse_body
from multiserve.server.protocol import ToolDef


class ParseFunctionCallBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: str
    tool_call_parser: str | None = None
    tools: list[ToolDef] = []


class SeparateReasoningBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: str
    reasoning_parser: str | None = None


class ParsedCall(BaseModel):
    tool_index: int
    name: str
    parameters: str


class ParseFunctionCallAnswer(BaseModel):
    normal_text: str
    calls: list[ParsedCall]


class SeparateReasoningAnswer(BaseModel):
    text: str
    reasoning_text: str


def add_parse_routes(app: FastAPI, tool_call_parser_name: str | None,
                     reasoning_parser_name: str | None) -> None:
    """The two routes; a body without a parser name uses the server's own (400 if none)."""

    async def parse_function_call(request: Request) -> Response:
        body = parse_body(ParseFunctionCallBody, await request.body())
        name = body.tool_call_parser or tool_call_parser_name
        if name not in TOOL_PARSERS:
            raise bad_request(f"tool_call_parser: unknown parser {name!r}; known: "
                              f"{', '.join(sorted(TOOL_PARSERS))}", param="tool_call_parser")
        tools: list[dict[str, Any]] = [t.model_dump(exclude_none=True) for t in body.tools]
        normal, calls = tool_call_parser(name, tools).parse(body.text)
        return JSONResponse({"normal_text": normal, "calls": [
            {"tool_index": c.tool_index, "name": c.name, "parameters": c.parameters}
            for c in calls]})

    async def separate_reasoning(request: Request) -> Response:
        body = parse_body(SeparateReasoningBody, await request.body())
        name = body.reasoning_parser or reasoning_parser_name
        if name not in REASONING_PARSERS:
            raise bad_request(f"reasoning_parser: unknown parser {name!r}; known: "
                              f"{', '.join(sorted(REASONING_PARSERS))}",
                              param="reasoning_parser")
        reasoning, text = reasoning_parser(name).parse(body.text)
        return JSONResponse({"text": text, "reasoning_text": reasoning})

    app.add_api_route("/parse_function_call", parse_function_call, methods=["POST"])
    app.add_api_route("/separate_reasoning", separate_reasoning, methods=["POST"])
