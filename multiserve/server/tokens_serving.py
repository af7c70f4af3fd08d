"""vLLM's token-in / token-out endpoint: POST /inference/v1/generate.

Owns: turning a `TokensGenerateRequest` (prompt token ids, vLLM sampling parameters)
into one `GenerateRequest` on the same path as the native /generate, and its samples into
{request_id, choices: [{index, token_ids, logprobs, finish_reason}]}, or an SSE stream of
chunks carrying each choice's new ids.

Invariants: every validation error is raised before anything reaches the engine; the ids
are the engine's output ids exactly (a matched stop token included, as /generate's
output_ids); a stream always ends with `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from multiserve.server import protocol as P
from multiserve.server import protocol_tokens as T
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
from multiserve.server.request_run import RequestRun, finish_runs, merge_runs, start_runs
from multiserve.server.tokenizer import TokenizerManager
from multiserve.types import (
    EngineClient,
    GenerateRequest,
    SamplingParamsError,
    TokenLogprob,
    cache_namespace,
)


def token_logprobs(ids: list[int], lps: list[TokenLogprob], top: int) -> P.ChatLogprobs:
    """Chat-shaped logprobs whose tokens are named "token_id:<id>" (vLLM's form here)."""
    return P.ChatLogprobs(content=[
        P.ChatTokenLogprob(token=f"token_id:{tid}", logprob=finite(lp.logprob),
                           top_logprobs=[P.TopLogprob(token=f"token_id:{t}", logprob=finite(v))
                                         for t, v in lp.top[:top]])
        for tid, lp in zip(ids, lps, strict=False)])


class TokensServing:
    def __init__(self, engine: EngineClient, tm: TokenizerManager,
                 on_done: Callable[[RequestRun], None] | None = None) -> None:
        self.engine = engine
        self.tm = tm
        self.on_done = on_done

    def _run(self, req: T.TokensGenerateRequest) -> RequestRun:
        refused = req.refused()
        if refused is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", param=refused[0])
        if not req.token_ids:
            raise bad_request("token_ids: must not be empty", param="token_ids")
        sp = req.sampling_params
        budget = self.tm.resolve_max_tokens(len(req.token_ids), sp.max_tokens,
                                            "sampling_params.max_tokens")
        try:
            sampling = sp.to_sampling(budget)
        except SamplingParamsError as exc:
            raise from_sampling_error(exc, T.PARAM_NAMES) from None
        check_health(self.engine)
        greq = GenerateRequest(rid=req.request_id or self.tm.new_rid(),
                               input_ids=tuple(req.token_ids), sampling=sampling,
                               stream=bool(req.stream),
                               cache_salt=cache_namespace(req.cache_salt, None))
        # the engine checks the ids and the budget; its refusals name this API's fields
        return RequestRun(self.engine, self.tm, greq, on_done=self.on_done,
                          fields={"input_ids": "token_ids",
                                  "max_new_tokens": "sampling_params.max_tokens"})

    async def generate(self, request: Request) -> Response:
        req = parse_body(T.TokensGenerateRequest, await request.body())
        run = self._run(req)
        top = req.sampling_params.logprobs or 0
        wants_lp = req.sampling_params.logprobs is not None
        if req.stream:
            await start_runs([run])  # refusals become HTTP errors, not mid-stream events
            return sse_response(self._stream(req, run, top, wants_lp))
        await finish_runs(request, [run])
        choices = [T.TokensChoice(index=s.index, token_ids=list(s.token_ids),
                                  logprobs=token_logprobs(s.token_ids, s.logprobs, top)
                                  if wants_lp else None,
                                  finish_reason=s.finish_reason)  # type: ignore[arg-type]
                   for s in run.samples]
        return json_model(T.TokensGenerateResponse(request_id=run.rid, choices=choices,
                                                   usage=_usage(run)))

    async def _stream(self, req: T.TokensGenerateRequest, run: RequestRun, top: int,
                      wants_lp: bool) -> AsyncIterator[str]:
        try:
            async for _, ev in merge_runs([run]):
                if not (ev.token_ids or ev.finished):
                    continue
                choice = T.TokensChoice(
                    index=ev.index, token_ids=list(ev.token_ids),
                    logprobs=token_logprobs(ev.token_ids, ev.logprobs, top) if wants_lp
                    else None, finish_reason=ev.finish_reason)  # type: ignore[arg-type]
                yield sse_data(T.TokensGenerateResponse(request_id=run.rid, choices=[choice]))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield sse_error(exc)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse_data(T.TokensGenerateResponse(request_id=run.rid, choices=[],
                                                    usage=_usage(run)))
        yield SSE_DONE


def _usage(run: RequestRun) -> P.UsageInfo:
    return P.UsageInfo.build(run.prompt_tokens, run.completion_tokens, run.cached_tokens)
