"""The OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions.

Owns: turning OpenAI requests into `GenerateRequest`s (tokenize, validate, sample
params), and `RequestRun` events into OpenAI responses or SSE chunk streams, including
both logprobs shapes, echo, usage with cached tokens, and n > 1 / several prompts.

Invariants: every validation error is raised before anything reaches the engine; a
stream always ends with `data: [DONE]` (after an error event if the engine failed);
choice index = prompt index * n + sample index.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from multiserve.grammar.compiler import GrammarCompiler, GrammarError, tool_call_grammar
from multiserve.grammar.grammar import Grammar
from multiserve.server import protocol as P
from multiserve.server.chat_output import ChatOutputParser, ChatPiece
from multiserve.server.errors import bad_request, from_sampling_error
from multiserve.server.http_utils import (
    SSE_DONE,
    check_health,
    finite,
    json_model,
    parse_body,
    sse_data,
    sse_error,
    sse_response,
)
from multiserve.server.request_run import (
    RequestRun,
    SampleEvent,
    finish_runs,
    merge_runs,
    start_runs,
)
from multiserve.server.tokenizer import TokenizerManager
from multiserve.types import (
    EngineClient,
    GenerateRequest,
    SamplingParamsError,
    TokenLogprob,
    cache_namespace,
)


# Tool-call formats whose tool_choice `required` / named can be enforced by a grammar.
ENFORCEABLE_PARSERS = ("hermes", "qwen25")
# OpenAI's rule for a function name (dots allowed too, as SGLang and vLLM accept them).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class OpenAIServing:
    def __init__(self, engine: EngineClient, tm: TokenizerManager,
                 on_done: Callable[[RequestRun], None] | None = None, *,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        """`tool_call_parser`: the format tool calls are read in (a parsing.TOOL_PARSERS
        name); `reasoning_parser`: a parsing.REASONING_PARSERS name, or None (no split);
        `grammars`: compiles decoding constraints (None: constraints are refused)."""
        self.grammars = grammars
        self.engine = engine
        self.tm = tm
        self.on_done = on_done
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    # ---- /v1/models ---------------------------------------------------------------------
    async def models(self) -> P.ModelList:
        """The served model, then each loaded LoRA adapter (`root`: the served model)."""
        name = self.engine.model_name
        cards = [P.ModelCard(id=name, root=name, max_model_len=self.engine.context_len)]
        cards += [P.ModelCard(id=a, root=name, max_model_len=self.engine.context_len)
                  for a in await self._adapters()]
        return P.ModelList(data=cards)

    async def _adapters(self) -> list[str]:
        """The names of the engine's loaded LoRA adapters."""
        listed = await self.engine.acontrol("list_lora_adapters")
        return [a["name"] for a in listed.details["adapters"]]

    def _lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` may name (sent with lora_optional: the
        engine runs a loaded adapter of that name, else the base model, as before
        adapters existed); the served model's name or none: the base model."""
        return None if not model or model == self.engine.model_name else model

    # ---- shared -----------------------------------------------------------------------
    async def _grammar(self, req: P.ChatCompletionRequest | P.CompletionRequest,
                       tool_grammar: str | None = None,
                       tool_field: str = "tool_choice") -> Grammar | None:
        """The request's decoding constraint compiled (response_format, SGLang's
        constraint fields, or the tool-call grammar of tool_choice required / named, or
        of strict tools under auto, named `tool_field` in errors; a given constraint, or a
        server without a compiler, leaves the latter unenforced): off the event loop,
        cached, bounded by the compiler's timeout. 400 for a bad or doubled constraint,
        before anything is generated."""
        try:
            found = req.constraint()
        except ValueError as exc:
            param, why = exc.args
            raise bad_request(f"{param}: {why}", param=param) from None
        if tool_field == "tools" and (found is not None or self.grammars is None):
            tool_grammar = None  # strict tools under auto: enforced where it can be
        if tool_grammar is not None:
            if found is not None:
                raise bad_request(f"{found[0]}: cannot be combined with tool_choice "
                                  "'required' or a named function", param=found[0])
            found = (tool_field, "tool_call", tool_grammar)
        if found is None:
            return None
        if self.grammars is None:
            raise bad_request(f"{found[0]}: constrained decoding is not available on this "
                              "server", param=found[0], code="constrained_decoding_unsupported")
        try:
            return await self.grammars.acompile(found[1], found[2], found[0])
        except GrammarError as exc:
            raise bad_request(str(exc), param=exc.field, code="invalid_grammar") from None

    def _runs(self, req: P.ChatCompletionRequest | P.CompletionRequest,
              prompts: list[list[int]], echo_logprobs: bool = False,
              grammar: Grammar | None = None, lora_name: str | None = None
              ) -> list[RequestRun]:
        refused = req.refused()
        if refused is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", param=refused[0])
        param, max_tokens = req.max_new_tokens_param
        budgets = [self.tm.resolve_max_tokens(len(ids), max_tokens, param) for ids in prompts]
        rename = dict(P.OPENAI_PARAM_NAMES, max_new_tokens=param)
        if isinstance(req, P.CompletionRequest):
            rename["top_logprobs_num"] = "logprobs"
        try:
            params = [P.openai_sampling(req, b) for b in budgets]
            if grammar is not None:
                params = [p.with_updates(grammar=grammar) for p in params]
        except SamplingParamsError as exc:
            raise from_sampling_error(exc, rename) from None
        check_health(self.engine)
        base = req.rid or self.tm.new_rid()
        runs = []
        for i, (ids, sp) in enumerate(zip(prompts, params, strict=False)):
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            greq = GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=sp,
                                   stream=req.stream, return_prompt_logprobs=echo_logprobs,
                                   lora_name=lora_name, lora_optional=True,
                                   cache_salt=cache_namespace(req.cache_salt, req.extra_key))
            # the engine checks the request; its refusals name OpenAI's fields
            runs.append(RequestRun(self.engine, self.tm, greq, on_done=self.on_done,
                                   fields={"input_ids": "prompt", "max_new_tokens": param}))
        return runs

    def _usage(self, runs: list[RequestRun]) -> P.UsageInfo:
        return P.UsageInfo.build(sum(r.prompt_tokens for r in runs),
                                 sum(r.completion_tokens for r in runs),
                                 sum(r.cached_tokens for r in runs))

    # ---- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = parse_body(P.ChatCompletionRequest, await request.body())
        if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
            raise bad_request("top_logprobs: requires logprobs=true", param="top_logprobs")
        tools, tool_grammar = self._chat_tools(req)
        grammar = await self._grammar(req, tool_grammar, "tools" if req.tool_choice in (
            None, "auto") else "tool_choice")
        add_generation_prompt, template_kwargs = req.template_args()
        ids = self.tm.apply_chat_template(req.messages, add_generation_prompt, tools,
                                          **template_kwargs)
        if tools:  # tool tags may be special tokens: the parser must see them
            req = req.model_copy(update={"skip_special_tokens": False})
        runs = self._runs(req, [ids], grammar=grammar, lora_name=self._lora_name(req.model))
        if req.stream:
            await start_runs(runs)  # refusals become HTTP errors, not mid-stream events
            return sse_response(self._chat_stream(req, runs[0], tools))
        await finish_runs(request, runs)
        run = runs[0]
        choices = []
        for s in run.samples:
            message, finish = P.ChatResponseMessage(content=s.text), s.finish_reason
            parser = self._output_parser(req, tools)
            if parser is not None:
                piece = parser.feed(s.text)
                piece += parser.flush()
                message = P.ChatResponseMessage(
                    content=piece.content if piece.content or not parser.has_calls else None,
                    reasoning_content=piece.reasoning or None,
                    tool_calls=[P.ToolCallOut(id=parser.ids[d.index], function=P.FunctionCallOut(
                        name=d.name, arguments=_arguments(piece, d.index)))
                        for d in piece.calls if d.name is not None] or None)
                finish = _finish_reason(finish, parser)
            choices.append(P.ChatChoice(
                index=s.index, message=message,
                logprobs=self._chat_logprobs(s.token_ids, s.logprobs, req)
                if req.logprobs else None, finish_reason=finish, matched_stop=s.matched_stop,
                token_ids=list(s.token_ids) if req.return_token_ids else None))
        return json_model(P.ChatCompletionResponse(
            id=run.rid, model=self.engine.model_name, choices=choices, usage=self._usage(runs),
            prompt_token_ids=list(ids) if req.return_token_ids else None))

    def _chat_tools(self, req: P.ChatCompletionRequest
                    ) -> tuple[list[dict[str, Any]] | None, str | None]:
        """(the tools to render and parse for (None: no tool calling), the grammar that
        enforces tool_choice `required` / a named function, or under `auto` the strict
        tools (None: not enforced)), after checking tools and tool_choice (400s). The
        enforced form is the hermes `<tool_call>` one: as a JSON list in one block when
        the generic tool prompt renders the tools (it asks for that), else one object per
        block. Under `auto` with some `strict: true` tool: text that writes no
        `<tool_call>`, or text then calls whose arguments validate against a strict
        tool's schema (any JSON object for a tool not marked strict); only in the
        enforceable formats (elsewhere `auto` is not constrained)."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise bad_request("tool_choice: only allowed when tools are given",
                                  param="tool_choice")
            return None, None
        seen: set[str] = set()
        for i, tool in enumerate(req.tools):
            name = tool.function.name
            if not _TOOL_NAME.fullmatch(name):
                raise bad_request(f"tools[{i}].function.name: must be 1-64 letters, digits, "
                                  f"'_', '.' or '-'; got {name[:80]!r}",
                                  param=f"tools[{i}].function.name")
            if name in seen:
                raise bad_request(f"tools[{i}].function.name: {name!r} is given twice",
                                  param=f"tools[{i}].function.name")
            seen.add(name)
        if choice == "none":
            return None, None
        if isinstance(choice, P.NamedToolChoice) and choice.function.name not in seen:
            raise bad_request(f"tool_choice: no tool named {choice.function.name[:80]!r} in "
                              f"tools", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice == "required" or isinstance(choice, P.NamedToolChoice):
            if self.tool_call_parser not in ENFORCEABLE_PARSERS:
                raise bad_request(
                    f"tool_choice: 'required' and a named function are enforced in the "
                    f"{'/'.join(ENFORCEABLE_PARSERS)} format; this server parses "
                    f"{self.tool_call_parser!r}: use 'auto'", param="tool_choice",
                    code="constrained_decoding_unsupported")
            name = choice.function.name if isinstance(choice, P.NamedToolChoice) else None
            return tools, tool_call_grammar(tools, name, req.parallel_tool_calls,
                                            list_form=not self.tm.template_reads_tools)
        if any(t.function.strict for t in req.tools) and \
                self.tool_call_parser in ENFORCEABLE_PARSERS:
            schemas = [t if t["function"].get("strict") else
                       {**t, "function": {**t["function"], "parameters": {"type": "object"}}}
                       for t in tools]
            return tools, tool_call_grammar(schemas, None, req.parallel_tool_calls,
                                            list_form=not self.tm.template_reads_tools,
                                            free_text=True)
        return tools, None

    def _output_parser(self, req: P.ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None) -> ChatOutputParser | None:
        reasoning = self.reasoning_parser if req.separate_reasoning else None
        tool_parser = self.tool_call_parser if tools else None
        if reasoning is None and tool_parser is None:
            return None
        # a named tool_choice is one call (its grammar writes one; the parser keeps one)
        parallel = req.parallel_tool_calls and not isinstance(req.tool_choice,
                                                               P.NamedToolChoice)
        return ChatOutputParser(reasoning, tool_parser, tools, parallel, req.stream_reasoning)

    def _token_info(self, tid: int, req: P.ChatCompletionRequest | P.CompletionRequest
                    ) -> tuple[str, bytes]:
        """(how a logprob entry names the token, the token's raw bytes): its text, or
        "token_id:<id>" under return_tokens_as_token_ids (as vLLM; the bytes stay the
        token's own)."""
        text, raw = self.tm.token_info(tid)
        return (f"token_id:{tid}" if req.return_tokens_as_token_ids else text), raw

    def _chat_logprobs(self, ids: list[int], lps: list[TokenLogprob],
                       req: P.ChatCompletionRequest) -> P.ChatLogprobs:
        content = []
        for tid, lp in zip(ids, lps, strict=False):
            s, b = self._token_info(tid, req)
            top = []
            for t, v in lp.top[:req.top_logprobs_num]:
                ts, tb = self._token_info(t, req)
                top.append(P.TopLogprob(token=ts, logprob=finite(v), bytes=list(tb)))
            content.append(P.ChatTokenLogprob(token=s, logprob=finite(lp.logprob), bytes=list(b),
                                              top_logprobs=top))
        return P.ChatLogprobs(content=content)

    async def _chat_stream(self, req: P.ChatCompletionRequest, run: RequestRun,
                           tools: list[dict[str, Any]] | None) -> AsyncIterator[str]:
        created, model = int(time.time()), self.engine.model_name
        parsers = {i: self._output_parser(req, tools) for i in range(req.n)}
        want_ids = bool(req.return_token_ids)

        def chunk(choice: P.ChatChunkChoice, prompt_ids: list[int] | None = None) -> str:
            return sse_data(P.ChatCompletionChunk(id=run.rid, created=created, model=model,
                                                  choices=[choice],
                                                  prompt_token_ids=prompt_ids))

        for i in range(req.n):  # each choice's first chunk: the role (and the prompt ids)
            yield chunk(P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant",
                                                                        content="")),
                        list(run.request.input_ids) if want_ids else None)
        try:
            async for _, ev in merge_runs([run]):
                logprobs = (self._chat_logprobs(ev.token_ids, ev.logprobs, req)
                            if req.logprobs and ev.token_ids else None)
                parser, finish = parsers.get(ev.index), ev.finish_reason
                if parser is None:
                    delta = P.DeltaMessage(content=ev.text) if ev.text else P.DeltaMessage()
                    payload = bool(ev.text)
                else:
                    piece = parser.feed(ev.text) if ev.text else ChatPiece()
                    if ev.finished:
                        piece += parser.flush()
                        finish = _finish_reason(finish, parser)
                    delta = _delta(piece, parser)
                    payload = bool(piece.content or piece.reasoning or delta.tool_calls)
                # with token ids, every new id is sent, even one whose text is held back
                if payload or logprobs is not None or ev.finished or (want_ids and ev.token_ids):
                    yield chunk(P.ChatChunkChoice(
                        index=ev.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                        matched_stop=ev.matched_stop,
                        token_ids=list(ev.token_ids) if want_ids else None))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield sse_error(exc)
        if req.include_usage:
            yield sse_data(P.ChatCompletionChunk(id=run.rid, created=created, model=model,
                                                 choices=[], usage=self._usage([run])))
        yield SSE_DONE

    # ---- /v1/completions ------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt: must not be empty", param="prompt")
        if isinstance(prompt[0], str):
            for p in prompt:  # every one before any is tokenized
                self.tm.check_prompt_chars(len(p), "prompt")
            return [self.tm.encode(p) for p in prompt]
        batch = [prompt] if isinstance(prompt[0], int) else prompt
        return [list(ids) for ids in batch]  # token ids: the engine checks them

    async def completions(self, request: Request) -> Response:
        req = parse_body(P.CompletionRequest, await request.body())
        if req.logprobs is not None and req.logprobs < 0:
            raise bad_request("logprobs: must be >= 0", param="logprobs")
        grammar = await self._grammar(req)
        prompts = self._prompt_ids(req.prompt)
        echo_lp = req.echo and req.logprobs is not None
        runs = self._runs(req, prompts, echo_logprobs=echo_lp, grammar=grammar,
                          lora_name=self._lora_name(req.model))
        if req.stream:
            await start_runs(runs)
            return sse_response(self._completion_stream(req, runs, prompts))
        await finish_runs(request, runs)
        choices = []
        for p, run in enumerate(runs):
            prefix = self.tm.decode(prompts[p]) if req.echo else ""
            for s in run.samples:
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(run, s.token_ids, s.logprobs, req,
                                                   prompts[p] if req.echo else None, 0)
                choices.append(P.CompletionChoice(
                    index=p * req.n + s.index, text=prefix + s.text, logprobs=lp,
                    finish_reason=s.finish_reason, matched_stop=s.matched_stop,
                    prompt_token_ids=list(prompts[p]) if req.return_token_ids else None,
                    token_ids=list(s.token_ids) if req.return_token_ids else None))
        return json_model(P.CompletionResponse(id=runs[0].rid, model=self.engine.model_name,
                                               choices=choices, usage=self._usage(runs)))

    def _completion_logprobs(self, run: RequestRun, ids: list[int], lps: list[TokenLogprob],
                             req: P.CompletionRequest, prompt_ids: list[int] | None,
                             offset: int) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        k = req.top_logprobs_num

        def add(tid: int, lp: TokenLogprob | None) -> None:
            nonlocal offset
            s = self._token_info(tid, req)[0]
            out.tokens.append(s)
            out.token_logprobs.append(None if lp is None else finite(lp.logprob))
            out.top_logprobs.append(None if lp is None else
                                    {self._token_info(t, req)[0]: finite(v)
                                     for t, v in lp.top[:k]})
            out.text_offset.append(offset)
            offset += len(s)

        if prompt_ids is not None:
            plps = run.prompt_logprobs or ()
            for j, tid in enumerate(prompt_ids):
                add(tid, plps[j] if j < len(plps) else None)
        for tid, lp in zip(ids, lps, strict=False):
            add(tid, lp)
        return out

    async def _completion_stream(self, req: P.CompletionRequest, runs: list[RequestRun],
                                 prompts: list[list[int]]) -> AsyncIterator[str]:
        created, model, rid = int(time.time()), self.engine.model_name, runs[0].rid
        offsets: dict[int, int] = {}
        started: set[int] = set()  # choices whose first chunk is sent (echo, prompt ids)
        want_ids = bool(req.return_token_ids)

        def chunk(index: int, text: str, lp: P.CompletionLogprobs | None,
                  ev: SampleEvent, prompt_ids: list[int] | None) -> str:
            return sse_data(P.CompletionResponse(
                id=rid, created=created, model=model, choices=[P.CompletionChoice(
                    index=index, text=text, logprobs=lp, finish_reason=ev.finish_reason,
                    matched_stop=ev.matched_stop, prompt_token_ids=prompt_ids,
                    token_ids=list(ev.token_ids) if want_ids else None)]))

        try:
            async for p, ev in merge_runs(runs):
                index = p * req.n + ev.index
                text, echo_ids = ev.text, None
                first = index not in started
                started.add(index)
                if req.echo and first:
                    text, echo_ids = self.tm.decode(prompts[p]) + text, prompts[p]
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(runs[p], ev.token_ids, ev.logprobs, req,
                                                   echo_ids, offsets.get(index, 0))
                    offsets[index] = (lp.text_offset[-1] + len(lp.tokens[-1])
                                      if lp.tokens else offsets.get(index, 0))
                yield chunk(index, text, lp, ev,
                            list(prompts[p]) if want_ids and first else None)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield sse_error(exc)
        if req.include_usage:
            yield sse_data(P.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                                usage=self._usage(runs)))
        yield SSE_DONE


def _arguments(piece: ChatPiece, index: int) -> str:
    return "".join(d.arguments for d in piece.calls if d.index == index)


def _finish_reason(reason: str | None, parser: ChatOutputParser) -> Any:
    """"tool_calls" for a reply that ended normally with calls in it."""
    return "tool_calls" if parser.has_calls and reason == "stop" else reason


def _delta(piece: ChatPiece, parser: ChatOutputParser) -> P.DeltaMessage:
    calls = []
    for d in piece.calls:
        if d.name is not None:  # a call's first delta: index, id, type, name
            calls.append(P.DeltaToolCall(index=d.index, id=parser.ids[d.index], type="function",
                                         function=P.FunctionCallOut(name=d.name, arguments="")))
        else:
            calls.append(P.DeltaToolCall(index=d.index,
                                         function=P.FunctionCallOut(arguments=d.arguments)))
    return P.DeltaMessage(content=piece.content or None,
                          reasoning_content=piece.reasoning or None, tool_calls=calls or None)
