"""Schema fuzzing (quick profile): schemathesis against the engine app and the supervisor
app of a 1-engine tiny fleet on loopback, positive and negative bodies for every
operation of their OpenAPI documents. No 5xx, every 4xx an OpenAI error body, no hung
request, SSE streams end with [DONE], every answer (each SSE event too) matches what the
document declares; afterwards every engine is healthy, idle and its KV whole. Long run:
`multiserve fuzz --cases 1000` (README, "Reliability runs").
"""

from __future__ import annotations

from pathlib import Path

import pytest

CASES_PER_APP = 150


STREAMING = {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate",
             "POST /inference/v1/generate"}


@pytest.fixture(scope="module")
def result(tiny_model: Path):  # noqa: ANN201
    """The fuzz run; then, on the same fleet (one fleet start for the file), 12 cases of
    the engine app's streamed routes (test_streamed_events_match_the_document), which the
    run's post-check covers too."""
    from multiserve.reliability.fuzz import fuzz_server
    from multiserve.reliability.fuzz_run import run_fuzz

    return run_fuzz(CASES_PER_APP, seed=0, model_dir=tiny_model,
                    then=lambda fleet: fuzz_server("engine", fleet.urls[0], 12,
                                                   operations=STREAMING))


def test_no_server_error_and_error_bodies_everywhere(result) -> None:  # noqa: ANN001
    print("\n".join(result.lines()))
    assert [r.name for r in result.reports] == ["engine", "supervisor", "front_door"]
    for r in result.reports:
        budget = CASES_PER_APP // 3 if r.name == "front_door" else CASES_PER_APP
        assert r.server_errors == 0, r.lines()
        assert not r.violations, r.violations[:10]
        assert r.cases >= budget * 0.6, r.lines()
        assert 200 in r.statuses and 400 in r.statuses, r.statuses
    assert not result.problems, result.problems
    assert result.ok


def test_every_operation_was_fuzzed(result) -> None:  # noqa: ANN001
    engine, supervisor, door = result.reports
    new = ("POST /pause", "POST /resume", "GET /is_paused", "POST /start_weight_update",
           "POST /update_weights", "POST /finish_weight_update",
           "POST /init_weight_transfer_engine", "POST /init_weights_update_group",
           "POST /update_weights_from_distributed",
           "POST /destroy_weights_update_group")  # issue 63
    for path in ("POST /v1/chat/completions", "POST /v1/completions", "POST /generate",
                 "POST /inference/v1/generate", "POST /v1/score", "POST /pause_generation",
                 "POST /abort_request", "POST /update_weights_from_disk",
                 "POST /stage_weights_from_disk", "POST /publish_staged_weights",
                 "POST /release_memory_occupation", "GET /health", "GET /metrics",
                 "POST /load_lora_adapter", "POST /unload_lora_adapter",
                 "POST /areal_pause_generation", *new):
        assert engine.per_operation[path] >= 1, path
    for path in ("POST /pause_generation", "POST /restart_engine", "POST /flush_cache",
                 "POST /update_weights_from_disk", "GET /health", *new):
        assert supervisor.per_operation[path] >= 1, path
    for path in ("POST /v1/chat/completions", "POST /v1/completions", "POST /generate",
                 "POST /inference/v1/generate", "GET /health", "GET /routing_stats",
                 "POST /finish_session"):
        assert door.per_operation[path] >= 1, path


def test_documents_declare_bodies_and_errors(tiny_model: Path) -> None:
    """In process: every POST that parses a body declares it, and every operation
    declares its success and its error answers (the OpenAI error schema)."""
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
    from multiserve.server.api_schema import BODIES
    from multiserve.server.openapi_docs import ErrorBody

    sup = build_supervisor_app([])
    add_rl_supervisor_routes(sup)
    doc = sup.openapi()
    for path in ("/pause_generation", "/restart_engine", "/update_weights_from_disk"):
        op = doc["paths"][path]["post"]
        assert "requestBody" in op and "200" in op["responses"] and "400" in op["responses"]
    assert ErrorBody.__name__ in doc["components"]["schemas"]
    assert ("POST", "/generate") in BODIES and ("POST", "/v1/chat/completions") in BODIES


def test_documents_declare_the_jax_weight_transfer() -> None:
    """SGLang's weights-update group routes are in both documents with SGLang's fields,
    the "jax" backend and our transfer_uuid (issue 63)."""
    from multiserve.fleet.supervisor import build_supervisor_app
    from multiserve.fleet.supervisor_rl import add_rl_supervisor_routes
    from multiserve.server.api_schema import BODIES as ENGINE_BODIES

    sup = build_supervisor_app([])
    add_rl_supervisor_routes(sup)
    doc = sup.openapi()
    for bodies, paths in ((ENGINE_BODIES, None), (None, doc["paths"])):
        for path, fields in (("/init_weights_update_group", {
                "master_address", "master_port", "rank_offset", "world_size", "group_name",
                "backend"}), ("/update_weights_from_distributed", {
                "names", "dtypes", "shapes", "group_name", "flush_cache",
                "abort_all_requests", "weight_version", "transfer_uuid"}),
                ("/destroy_weights_update_group", {"group_name"})):
            if bodies is not None:
                schema = bodies[("POST", path)].model_json_schema()
            else:
                ref = paths[path]["post"]["requestBody"]["content"]["application/json"][
                    "schema"]["$ref"].rsplit("/", 1)[1]
                schema = doc["components"]["schemas"][ref]
                assert {"200", "400"} <= set(paths[path]["post"]["responses"]), path
            assert fields <= set(schema["properties"]), (path, schema["properties"])
            if path == "/update_weights_from_distributed":
                assert "await_pull" in str(schema["properties"]["transfer_uuid"])
            if path == "/init_weights_update_group":
                assert "jax" in str(schema["properties"]["backend"])


def test_streamed_events_match_the_document(result) -> None:  # noqa: ANN001
    """Issue 21: every SSE event of a streamed answer (chunks, usage chunk, [DONE]) matches
    the event schema the engine app's document declares (it said "a string"); the
    streamed routes fuzzed on their own after the main run (the `result` fixture)."""
    from multiserve.reliability.fuzz import STREAM_EXAMPLES

    report = result.then
    print("\n".join(report.lines()))
    assert set(STREAM_EXAMPLES) == STREAMING
    for label in STREAMING:
        assert report.per_status[(label, 200)] >= 1, report.per_status
    assert report.ok and not report.violations, report.violations[:5]


def test_an_answer_disagreeing_with_the_document_fails_the_run() -> None:
    """A server whose streamed events do not match its own document: the fuzzer counts it
    as a violation (the run fails), not as a finding."""
    from fastapi import FastAPI
    from starlette.responses import StreamingResponse

    from multiserve.reliability.fuzz import fuzz_server
    from multiserve.server import protocol as P
    from multiserve.server.openapi_docs import Answer, document
    from multiserve.server.server_thread import ServerThread

    app = FastAPI()

    @app.post("/v1/completions", response_model=None)
    async def completions():  # noqa: ANN202 - a local route
        async def events():  # noqa: ANN202
            yield 'data: {"id": 7, "choices": "none"}\n\n'  # not a CompletionResponse
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    key = ("POST", "/v1/completions")
    document(app, {key: P.CompletionRequest},
             {key: Answer(P.CompletionResponse, stream=P.CompletionResponse)})
    with ServerThread(app) as server:
        report = fuzz_server("liar", server.url, 4)
    assert not report.ok
    assert any("does not match the document" in v and "SSE event" in v
               for v in report.violations), report.violations[:3]


def test_documents_declare_tools_and_constraints() -> None:
    """The fields of tool calling and constrained decoding are in the engine app's
    document with their shapes, so schemathesis generates them: chat `tools`,
    `tool_choice`, `response_format` (each type), SGLang's constraint fields, and the
    same keys in /generate's `sampling_params`."""
    from fastapi import FastAPI

    from multiserve.sampling_policy import GRAMMAR_KEYS
    from multiserve.server.api_schema import document_engine_app

    app = FastAPI()
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        app.add_api_route(path, lambda: None, methods=["POST"])
    document_engine_app(app, "m", 100)
    schemas = app.openapi()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format",
            *GRAMMAR_KEYS} <= set(chat)
    assert "$ref" in str(chat["tools"]) and "ToolDef" in schemas and "strict" in str(
        schemas["FunctionDef"])
    assert "required" in str(chat["tool_choice"]) and "NamedToolChoice" in str(
        chat["tool_choice"])
    kinds = str(chat["response_format"])
    assert all(k in kinds for k in ("json_object", "json_schema", "structural_tag"))
    assert chat["regex"]["anyOf"][0]["type"] == "string"
    body = schemas["GenerateRequestBody"]["properties"]["sampling_params"]["anyOf"][0]
    assert set(GRAMMAR_KEYS) <= set(body["properties"])


def test_documents_declare_token_ids() -> None:
    """vLLM's token-id fields are in the engine app's document: the request flags on chat
    and completions, the answer fields (chat: prompt ids at the top, completions: in each
    choice; streamed chunks the same), and /inference/v1/generate's body (prompt ids in
    the vocabulary, its refused sampling options null only) and answer."""
    from fastapi import FastAPI

    from multiserve.server.api_schema import document_engine_app
    from multiserve.server.protocol_tokens import REFUSED_OPTIONS

    app = FastAPI()
    for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate"):
        app.add_api_route(path, lambda: None, methods=["POST"])
    document_engine_app(app, "m", 100)
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        assert {"return_token_ids", "return_tokens_as_token_ids"} <= set(
            schemas[name]["properties"])
    assert "prompt_token_ids" in schemas["ChatCompletionResponse"]["properties"]
    assert "prompt_token_ids" in schemas["ChatCompletionChunk"]["properties"]
    assert "token_ids" in schemas["ChatChoice"]["properties"]
    assert "token_ids" in schemas["ChatChunkChoice"]["properties"]
    assert {"prompt_token_ids", "token_ids"} <= set(schemas["CompletionChoice"]["properties"])
    body = schemas["TokensGenerateRequest"]
    assert "token_ids" in body["required"]
    ids = body["properties"]["token_ids"]
    assert ids["minItems"] == 1 and ids["items"] == {"type": "integer", "minimum": 0,
                                                     "maximum": 99}
    sp = schemas["TokensSamplingParams"]
    assert sp["additionalProperties"] is False
    assert all(sp["properties"][k]["type"] == "null" for k in REFUSED_OPTIONS)
    op = doc["paths"]["/inference/v1/generate"]["post"]
    assert "requestBody" in op and {"200", "400", "503"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]
