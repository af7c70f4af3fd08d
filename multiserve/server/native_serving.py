"""The native (sglang-compatible) endpoints: /generate and /v1/score.

Owns: /generate over text or input_ids (single or batch, n samples each), streamed as
SSE chunks carrying the CUMULATIVE text and output_ids of one sample (sglang's
default), or answered as one object (single prompt, n == 1) or a list; and /v1/score,
which scores each item by a 1-token greedy generation on query+item with
`token_ids_logprob=label_token_ids`, reading the label logprobs at the first generated
position (the next-token distribution after the prompt).

With `return_routed_experts` (a MoE model on an engine started with the flag) the final
object or chunk of each sample carries meta_info.routed_experts (types.RoutedExperts, base64
as SGLang sends it), aborted samples included.

Invariant: meta_info.finish_reason is {"type": "stop", "matched": ...} |
{"type": "length", "length": n} | {"type": "abort", "message": ...}.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.grammar.compiler import GrammarCompiler, GrammarError
from multiserve.server import protocol_native as N
from multiserve import sampling_policy as S
from multiserve.server.errors import ApiError, bad_request, from_sampling_error
from multiserve.server.http_utils import (
    SSE_DONE,
    check_health,
    finite,
    parse_body,
    sse_data,
    sse_error,
    sse_response,
)
from multiserve.server.request_run import (
    RequestRun,
    SampleState,
    finish_runs,
    merge_runs,
    start_runs,
)
from multiserve.server.tokenizer import TokenizerManager, score_softmax
from multiserve.types import (
    EngineClient,
    GenerateRequest,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
)


def _finish_reason(s: SampleState) -> dict[str, Any] | None:
    if not s.done:
        return None
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    if s.finish_reason == "abort":
        return {"type": "abort", "message": s.error or "aborted"}
    return {"type": "stop", "matched": s.matched_stop}


class NativeServing:
    def __init__(self, engine: EngineClient, tm: TokenizerManager,
                 on_done: Callable[[RequestRun], None] | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        """`grammars`: compiles `sampling_params` constraints (None: they are refused)."""
        self.engine = engine
        self.tm = tm
        self.on_done = on_done
        self.grammars = grammars

    async def _grammars(self, raws: list[dict[str, Any]]) -> list[Any]:
        """Each sampling dict's constraint compiled (off the event loop, cached, bounded
        by the compiler's timeout); None where a dict has none. Raises ApiError 400."""
        out: list[Any] = []
        for raw in raws:
            try:
                key = S.grammar_key(raw)
            except SamplingParamsError as exc:
                raise from_sampling_error(exc) from None
            if key is None or self.grammars is None:
                out.append(None)
                continue
            try:
                out.append(await self.grammars.acompile(key[0], key[1], key[0]))
            except GrammarError as exc:
                raise bad_request(str(exc), param=exc.field,
                                  code="invalid_grammar") from None
        return out

    # ---- /generate ----------------------------------------------------------------------
    async def _build(self, body: N.GenerateRequestBody
                     ) -> tuple[list[RequestRun], bool, list[int]]:
        """(runs, is_batch, stream interval per run); every check before the engine."""
        refused = body.refused_feature()
        if refused is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", param=refused[0])
        try:
            prompts, is_batch = body.prompts()
        except ValueError as exc:
            raise bad_request(str(exc), param="text") from None
        for p in prompts:  # every text before any is tokenized
            if isinstance(p, str):
                self.tm.check_prompt_chars(len(p), "text")
        ids_list = [self.tm.encode(p) if isinstance(p, str) else p for p in prompts]
        if not ids_list:
            raise bad_request("no prompt given", param="text")
        try:
            raws = S.per_prompt(body.sampling_params, len(ids_list), is_batch)
        except SamplingParamsError as exc:
            raise from_sampling_error(exc) from None
        grammars = await self._grammars(raws)
        try:
            params = [body.sampling(raw, g) for raw, g in zip(raws, grammars, strict=True)]
            intervals = [S.stream_interval(raw) for raw in raws]
        except SamplingParamsError as exc:
            raise from_sampling_error(exc) from None
        rids = body.rid
        if isinstance(rids, list):
            if len(rids) != len(ids_list):
                raise bad_request("rid: need one rid per prompt", param="rid")
        else:
            base = rids or self.tm.new_rid()
            rids = [base] if len(ids_list) == 1 else [f"{base}-{i}" for i in range(len(ids_list))]
        try:
            loras = body.lora_names(len(ids_list))
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_path") from None
        try:
            keys = body.cache_keys(len(ids_list))
        except ValueError as exc:
            raise bad_request(str(exc), param="extra_key") from None
        check_health(self.engine)
        prompt_lp = body.return_logprob and body.logprob_start_len >= 0
        # an unknown adapter is the engine's refusal (400 lora_not_found, naming it)
        runs = [RequestRun(self.engine, self.tm,
                           GenerateRequest(rid=r, input_ids=tuple(ids), sampling=sp,
                                           stream=body.stream,
                                           return_prompt_logprobs=prompt_lp, lora_name=lora,
                                           return_routed_experts=bool(
                                               body.return_routed_experts),
                                           routed_experts_start_len=(
                                               body.routed_experts_start_len),
                                           cache_salt=key),
                           on_done=self.on_done, fields={"lora_name": "lora_path"})
                for r, ids, sp, lora, key in zip(rids, ids_list, params, loras, keys,
                                                 strict=True)]
        return runs, is_batch, intervals

    async def generate(self, request: Request) -> Response:
        body = parse_body(N.GenerateRequestBody, await request.body())
        runs, is_batch, intervals = await self._build(body)
        # The whole batch is admitted in one engine command (atomic), before any response.
        await start_runs(runs)
        if body.stream:
            return sse_response(self._generate_stream(body, runs, intervals))
        await finish_runs(request, runs)
        n = runs[0].request.sampling.n
        outs = [self._sample_out(body, run, s) for run in runs for s in run.samples]
        for i, o in enumerate(outs):
            o["index"] = i
        if not is_batch and n == 1:
            return JSONResponse(outs[0])
        return JSONResponse(outs)

    def _sample_out(self, body: N.GenerateRequestBody, run: RequestRun,
                    s: SampleState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": run.rid, "finish_reason": _finish_reason(s),
            "prompt_tokens": run.prompt_tokens, "completion_tokens": len(s.token_ids),
            "cached_tokens": run.cached_tokens, "weight_version": run.weight_version,
            "e2e_latency": run.e2e_latency,
            "spec_verify_ct": s.spec_verify_ct, "spec_accepted_tokens": s.spec_accepted_tokens}
        if s.done and s.matched_stop is not None:
            meta["matched_stop"] = s.matched_stop
        if run.weight_segments:
            meta["weight_segments"] = run.weight_segments
        if s.error:
            meta["error"] = s.error
        if body.return_logprob or body.top_logprobs_num or body.token_ids_logprob is not None:
            self._add_logprobs(meta, body, run, s.token_ids, s.logprobs)
        if s.routed_experts is not None:  # SGLang's form: base64 of the int32 bytes
            meta["routed_experts"] = base64.b64encode(s.routed_experts.data).decode("ascii")
        return {"text": s.text, "output_ids": list(s.token_ids), "index": s.index,
                "meta_info": meta}

    def _add_logprobs(self, meta: dict[str, Any], body: N.GenerateRequestBody, run: RequestRun,
                      ids: list[int], lps: list[TokenLogprob]) -> None:
        def txt(t: int) -> str | None:
            return self.tm.token_str(t) if body.return_text_in_logprobs else None

        def triple(t: int, v: float | None) -> list[Any]:
            return [None if v is None else finite(v), t, txt(t)]

        meta["output_token_logprobs"] = [triple(t, lp.logprob)
                                         for t, lp in zip(ids, lps, strict=False)]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[triple(t, v) for t, v in lp.top] for lp in lps]
        if body.token_ids_logprob is not None:
            meta["output_token_ids_logprob"] = [[triple(t, v) for t, v in lp.selected]
                                                for lp in lps]
        if run.prompt_logprobs is not None:
            start = max(body.logprob_start_len, 0)
            ids_in = run.request.input_ids
            meta["input_token_logprobs"] = [
                triple(ids_in[j], None if lp is None else lp.logprob)
                for j, lp in enumerate(run.prompt_logprobs) if j >= start and j < len(ids_in)]

    async def _generate_stream(self, body: N.GenerateRequestBody, runs: list[RequestRun],
                               intervals: list[int]) -> AsyncIterator[str]:
        n = runs[0].request.sampling.n
        sent: dict[tuple[int, int], int] = {}  # (prompt, sample) -> tokens when last sent
        try:
            async for p, ev in merge_runs(runs):
                run = runs[p]
                sample = run.samples[ev.index]
                # sglang's stream_interval: a chunk every k tokens (and the final one);
                # chunks are cumulative, so skipping some loses nothing.
                last = sent.get((p, ev.index), 0)
                if not ev.finished and len(sample.token_ids) - last < intervals[p]:
                    continue
                sent[(p, ev.index)] = len(sample.token_ids)
                out = self._sample_out(body, run, sample)
                out["index"] = p * n + ev.index
                yield sse_data(out)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield sse_error(exc)
        yield SSE_DONE

    # ---- /v1/score --------------------------------------------------------------------
    async def score(self, request: Request) -> Response:
        body = parse_body(N.ScoreRequest, await request.body())
        labels = list(body.label_token_ids)
        vocab = len(self.tm.tokenizer)
        if not labels or any(t < 0 or t >= vocab for t in labels):
            raise bad_request(f"label_token_ids: need 1+ token ids in [0, {vocab})",
                              param="label_token_ids")
        prompts = self._score_prompts(body)
        try:
            sp = SamplingParams(max_new_tokens=1, temperature=0.0, token_ids_logprob=tuple(labels))
        except SamplingParamsError as exc:
            raise from_sampling_error(exc, {"token_ids_logprob": "label_token_ids"}) from None
        check_health(self.engine)
        base = self.tm.new_rid()
        runs = [RequestRun(self.engine, self.tm,
                           GenerateRequest(rid=f"{base}-{i}", input_ids=tuple(ids), sampling=sp,
                                           stream=False), on_done=self.on_done,
                           fields={"input_ids": "items", "max_new_tokens": "items"})
                for i, ids in enumerate(prompts)]
        await finish_runs(request, runs)
        scores = []
        for run in runs:
            s = run.samples[0]
            if not s.logprobs:
                raise ApiError(500, f"engine returned no logprobs for {run.rid} "
                               f"(finish_reason={s.finish_reason})")
            got = dict(s.logprobs[0].selected)
            scores.append(score_softmax([got.get(t, float("-inf")) for t in labels],
                                        body.apply_softmax))
        usage = {"prompt_tokens": sum(r.prompt_tokens for r in runs),
                 "completion_tokens": 0,
                 "total_tokens": sum(r.prompt_tokens for r in runs)}
        return JSONResponse(N.ScoreResponse(scores=scores, model=self.engine.model_name,
                                            usage=usage).model_dump(mode="json"))

    def _score_prompts(self, body: N.ScoreRequest) -> list[list[int]]:
        items = [body.items] if isinstance(body.items, str) else list(body.items)
        if not items:
            raise bad_request("items: must not be empty", param="items")
        query = body.query
        if all(isinstance(i, str) for i in items):
            if query is not None and not isinstance(query, str):
                raise bad_request("query: must be text when items are text", param="query")
            q = query or ""
            for i in items:  # every item before any is tokenized
                self.tm.check_prompt_chars(len(i) + len(q), "items")
            return [self.tm.encode(i + q if body.item_first else q + i) for i in items]
        if query is not None and not isinstance(query, list):
            raise bad_request("query: must be token ids when items are token ids", param="query")
        q_ids = list(query or [])
        # token ids and lengths: the engine checks them (its refusals name `items`)
        return [list(i) + q_ids if body.item_first else q_ids + list(i) for i in items]
