"""FastAPI app for one engine: OpenAI, native, control and introspection endpoints.

Owns: `build_app(engine, tokenizer, ...)`, the routing table, and the mapping of every
error to an OpenAI-shaped body (400 invalid input, 404 unknown model/route, 429/503
queue full with Retry-After, 503 engine unavailable, 500 unexpected). The endpoint
logic lives in `openai_serving.py` and `native_serving.py`; the control routes are derived
from the table of operations (`control_routes.py`).

Invariants: the app holds no engine state of its own (everything introspective is
read from `acontrol("get_internal_state")` at request time); an error in one request never
affects another; nothing here imports jax.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from multiserve.config import DEFAULT_MAX_REQUEST_BYTES
from multiserve.parsing import REASONING_PARSERS, TOOL_PARSERS, detect_tool_call_parser
from multiserve.host.process_memory import process_memory
from multiserve.server.api_schema import document_engine_app
from multiserve.server.body_limit import limit_body
from multiserve.server.control_routes import add_control_routes
from multiserve.server.errors import ApiError, bad_request, overloaded
from multiserve.server.http_utils import api_error_from, error_json, json_model
from multiserve.server.metrics import CONTENT_TYPE, MetricsMiddleware, ServerMetrics
from multiserve.server.native_serving import NativeServing
from multiserve.server.openai_serving import OpenAIServing
from multiserve.server.parse_routes import add_parse_routes
from multiserve.server.request_run import ClientDisconnected, RequestRun, drain
from multiserve.server.tokenizer import TokenizerManager
from multiserve.server.tokens_serving import TokensServing
from multiserve.server.vllm_pause import add_vllm_pause_routes
from multiserve.grammar.compiler import GrammarCompiler
from multiserve.types import (
    ASLEEP,
    EngineClient,
    EngineOverloaded,
    EngineUnavailable,
    GenerateRequest,
    SamplingParams,
    is_asleep,
)

log = logging.getLogger("multiserve.server")
HEALTH_GENERATE_TIMEOUT_S = 60.0


def build_app(engine: EngineClient, tokenizer: TokenizerManager, *,
              metrics: ServerMetrics | None = None,
              server_info: dict[str, Any] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              enable_memory_saver: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """One app in front of one engine. `server_info` is merged into /get_server_info;
    `max_request_bytes` bounds a request body (413 beyond, server/body_limit.py);
    `enable_memory_saver` is the sglang server argument /get_server_info reports (memory
    release works either way); `tool_call_parser` (None: chosen from the chat template,
    `resolve_tool_call_parser`) and `reasoning_parser` (None: no reasoning split) name
    parsers of multiserve.parsing. All are `ServerConfig` fields."""
    metrics = metrics or ServerMetrics()
    tool_call_parser = resolve_tool_call_parser(tool_call_parser, tokenizer)
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown {reasoning_parser!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    info = {"served_model_name": engine.model_name, "context_len": engine.context_len,
            "enable_memory_saver": enable_memory_saver, "max_request_bytes": max_request_bytes,
            "max_prompt_chars": tokenizer.max_prompt_chars,
            "tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser,
            **(server_info or {})}
    grammars = grammar_compiler(engine, tokenizer)
    oai = OpenAIServing(engine, tokenizer, on_done=metrics.observe_run,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        grammars=grammars)
    native = NativeServing(engine, tokenizer, on_done=metrics.observe_run, grammars=grammars)
    tokens = TokensServing(engine, tokenizer, on_done=metrics.observe_run)
    app = FastAPI(title="multiserve", docs_url=None, redoc_url=None)
    app.state.engine, app.state.tokenizer, app.state.metrics = engine, tokenizer, metrics
    app.state.server_info = info  # read at request time: a launcher may add host/port

    # ---- OpenAI + native ------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> Response:
        return json_model(await oai.models())

    app.add_api_route("/v1/chat/completions", oai.chat, methods=["POST"])
    app.add_api_route("/v1/completions", oai.completions, methods=["POST"])
    app.add_api_route("/generate", native.generate, methods=["POST"])
    app.add_api_route("/inference/v1/generate", tokens.generate, methods=["POST"])  # vLLM's
    app.add_api_route("/v1/score", native.score, methods=["POST"])
    add_parse_routes(app, tool_call_parser, reasoning_parser)

    # ---- health + introspection -------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        ok, reason = engine.health()
        if ok and is_asleep(reason):  # memory released: healthy, not generating
            return JSONResponse({"status": ASLEEP, "message": reason})
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "message": reason,
                             **ApiError(503, f"engine unavailable: {reason}").body()}, 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ok, reason = engine.health()
        if not ok:
            raise ApiError(503, f"engine unavailable: {reason}", code="engine_unavailable")
        state = await engine.acontrol("get_internal_state")
        if state.get("engine_paused"):
            raise ApiError(503, "engine is paused: a health generation cannot run now",
                           code="engine_paused")
        ids = tokenizer.encode("ping") or [0]
        run = RequestRun(engine, tokenizer, GenerateRequest(
            rid=f"health-{tokenizer.new_rid()}", input_ids=tuple(ids),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0)))
        try:
            await asyncio.wait_for(drain(run), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(503, "health generation timed out", code="timeout") from None
        s = run.samples[0]
        if len(s.token_ids) != 1:
            raise ApiError(503, f"health generation produced {len(s.token_ids)} tokens "
                           f"(finish_reason={s.finish_reason})", code="engine_unavailable")
        return JSONResponse({"status": "ok", "output_ids": s.token_ids,
                             "latency": run.e2e_latency})

    async def get_model_info() -> Response:
        state = await engine.acontrol("get_internal_state")
        return JSONResponse({"model_path": info.get("model_path"),
                             "tokenizer_path": info.get("tokenizer_path"),
                             "served_model_name": engine.model_name, "is_generation": True,
                             "context_len": engine.context_len,
                             "weight_version": state.get("weight_version")})

    # sglang serves both names (sglang-router reads /model_info when it adds a worker)
    app.add_api_route("/get_model_info", get_model_info, methods=["GET"])
    app.add_api_route("/model_info", get_model_info, methods=["GET"])

    async def get_server_info() -> Response:
        state = await engine.acontrol("get_internal_state")
        return JSONResponse(_jsonable({**server_args(info, state), **info, **state,
                                       "process_memory": process_memory(),
                                       "internal_states": [state]}))

    # sglang serves both names (/server_info is the newer one)
    app.add_api_route("/get_server_info", get_server_info, methods=["GET"])
    app.add_api_route("/server_info", get_server_info, methods=["GET"])

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        state = await engine.acontrol("get_internal_state")
        return JSONResponse({"weight_version": state.get("weight_version")})

    @app.get("/v1/loads")
    async def loads() -> Response:
        """sglang's load report (slime polls it after /abort_request until the server is
        idle): one data-parallel rank, its request samples running and waiting."""
        state = await engine.acontrol("get_internal_state")
        return JSONResponse(load_report(state))

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        ok, _ = engine.health()
        try:
            state = await engine.acontrol("get_internal_state")
        except Exception:  # an unhealthy engine still gets its counters scraped
            state, ok = {}, False
        metrics.refresh(state, ok)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ---- control: the core operations of control_ops.OPS (pause, continue, abort, flush) ---
    add_control_routes(app, engine, "core")
    add_vllm_pause_routes(app, engine)  # vLLM's /pause, /resume, /is_paused (and AReaL's)

    _install_error_handlers(app)
    # the OpenAPI document declares every body and answer
    document_engine_app(app, engine.model_name, len(tokenizer.tokenizer))
    known = frozenset(r.path for r in app.routes if hasattr(r, "path"))
    limit_body(app, max_request_bytes)  # inside the metrics: a 413 is counted
    app.add_middleware(MetricsMiddleware, metrics=metrics, known_paths=known)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> Response:
        return error_json(exc)

    @app.exception_handler(EngineOverloaded)
    async def on_overloaded(_: Request, exc: EngineOverloaded) -> Response:
        return error_json(overloaded(exc))  # 429/503 + Retry-After

    @app.exception_handler(EngineUnavailable)
    async def on_unavailable(_: Request, exc: EngineUnavailable) -> Response:
        return error_json(ApiError(503, f"engine unavailable: {exc}", code="engine_unavailable"))

    @app.exception_handler(ValueError)
    async def on_rejected(_: Request, exc: ValueError) -> Response:
        return error_json(api_error_from(exc))  # the engine refused the request: 400

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; logged as "client closed"

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return error_json(bad_request(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_json(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error while serving a request")
        return error_json(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def grammar_compiler(engine: EngineClient, tokenizer: TokenizerManager) -> GrammarCompiler:
    """The compiler of this app's decoding constraints: the engine's tokenizer, its
    logits width (the model's vocabulary, else the tokenizer's) and its end ids."""
    model_cfg = getattr(engine, "model_config", None)
    vocab = getattr(model_cfg, "vocab_size", None) or len(tokenizer.tokenizer)
    eos = sorted({*tokenizer.eos_token_ids, *getattr(model_cfg, "eos_token_ids", ())})
    return GrammarCompiler.for_hf_tokenizer(tokenizer.tokenizer, vocab, eos)


def resolve_tool_call_parser(name: str | None, tokenizer: TokenizerManager) -> str:
    """The tool-call parser of this server: as configured (ValueError if unknown), else
    the one the chat template's tool-call format calls for, else `hermes` (what the
    generic tool prompt asks a template that ignores tools for: server/tool_prompt.py)."""
    if name is not None:
        if name not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown {name!r}; known: "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        return name
    return detect_tool_call_parser(tokenizer.chat_template) or "hermes"


def server_args(info: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The sglang server-args keys RL clients read from /get_server_info, with this
    engine's true values: each engine port is one server with one data-parallel rank, its
    device group is its tensor-parallel group, nothing is pipelined or expert-parallel.
    (`enable_memory_saver` comes from `info`: the option as set; memory can be released
    and resumed either way.)"""
    devices = info.get("device_indexes") or state.get("device_indexes")
    tp = len(devices) if devices else int(state.get("tp_size") or 1)
    out = {"tp_size": tp, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1,
           "node_rank": 0, "max_total_num_tokens": state.get("max_total_tokens")}
    if devices:  # sglang's device placement: the group's first device, consecutive ids
        contiguous = list(devices) == list(range(devices[0], devices[0] + len(devices)))
        out.update(base_gpu_id=devices[0], gpu_id_step=1 if contiguous else None)
    return out


def load_report(state: dict[str, Any]) -> dict[str, Any]:
    """The /v1/loads answer from the engine state (counts are request samples: n > 1
    counts n times, as sglang counts its requests)."""
    running, waiting = int(state["running_batch_size"]), int(state["waiting_queue_size"])
    total_tokens = int(state.get("max_total_tokens") or 0)
    used = max(0, total_tokens - int(state.get("available_kv_tokens") or 0)
               - int(state.get("evictable_kv_tokens") or 0))
    return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting, "num_used_tokens": used,
        "max_total_num_tokens": total_tokens,
        "token_usage": used / total_tokens if total_tokens else 0.0}]}


def _jsonable(x: Any) -> Any:
    """Make engine state JSON-safe (tuples → lists, unknown objects → str)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else str(x)
    return str(x)
