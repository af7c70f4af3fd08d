"""Native endpoints on the real engine: /generate, /v1/score, health, info, metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from multiserve.types import SamplingParams

pytestmark = pytest.mark.slow


def test_greedy_chat_over_http_equals_engine_generate(served, idle_engine):
    msgs = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
    ids = served.tm.apply_chat_template(msgs)
    assert ids == served.engine.chat_ids(msgs)
    with ThreadPoolExecutor(1) as pool:  # both at once: the engine batches them
        direct = pool.submit(served.engine.generate, input_ids=ids,
                             sampling_params=SamplingParams(temperature=0.0, max_new_tokens=20))
        r = served.http.post("/v1/chat/completions", json={
            "model": served.engine.model_name, "messages": msgs, "max_tokens": 20,
            "temperature": 0})
        out = direct.result()
    assert r.status_code == 200, r.text
    http_text = r.json()["choices"][0]["message"]["content"]
    assert http_text == out.text
    assert r.json()["usage"]["completion_tokens"] == len(out.output_ids)


def test_generate_text_ids_batch_logprobs_and_meta(served, idle_engine):
    h = served.http
    ids = served.tm.encode("The sky is")
    one = h.post("/generate", json={
        "text": "The sky is", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 2}).json()
    meta = one["meta_info"]
    assert len(one["output_ids"]) == 5 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(ids)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == served.state()["weight_version"]
    assert one["text"] == served.tm.decode(one["output_ids"])
    assert [t[1] for t in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(len(t) == 2 and t[0][0] >= t[1][0] for t in meta["output_top_logprobs"])
    # input (prompt) logprobs from position logprob_start_len on, sglang style
    scored = h.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0}).json()["meta_info"]
    inp = scored["input_token_logprobs"]
    assert [t[1] for t in inp] == ids and inp[0][0] is None
    assert all(t[0] is not None and t[0] <= 0 for t in inp[1:])

    def stream_lines() -> list[str]:
        with h.stream("POST", "/generate", json={
                "text": "The sky is", "stream": True, "rid": "native-stream-1",
                "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                    "ignore_eos": True}}) as s:
            return [ln for ln in s.iter_lines() if ln.startswith("data: ")]

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_lines)
        # Same prompt as ids, batched with another: identical greedy continuation.
        batch = h.post("/generate", json={
            "input_ids": [ids, served.tm.encode("Water is")],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                "ignore_eos": True}}).json()
        lines = streaming.result()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]
    assert batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]
    # Streaming: cumulative text and ids, last chunk carries the finish reason.
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["output_ids"] == one["output_ids"]
    assert chunks[-1]["text"] == one["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["id"] == "native-stream-1" for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_stop_string_reports_match(served, idle_engine):
    h = served.http
    base = h.post("/generate", json={"text": "1, 2, 3, 4,", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
    stop = base["text"][2:5]
    r = h.post("/generate", json={"text": "1, 2, 3, 4,", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}}).json()
    assert r["text"] == base["text"][:base["text"].find(stop)]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_score_softmax_matches_numpy_reference_from_generate(served, idle_engine):
    h = served.http
    tm = served.tm
    labels = [tm.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]
    query = "Question: is the sea salty? Answer:"
    items = [" Think about it.", " Sure, here goes.", " Well,"]
    body = {"query": query, "items": items, "label_token_ids": labels}
    soft = h.post("/v1/score", json={**body, "apply_softmax": True}).json()
    raw = h.post("/v1/score", json={**body, "apply_softmax": False}).json()
    assert len(soft["scores"]) == len(items)
    for k, item in enumerate(items):
        g = h.post("/generate", json={"text": query + item, "token_ids_logprob": labels,
                                      "sampling_params": {"max_new_tokens": 1,
                                                          "temperature": 0}}).json()
        sel = g["meta_info"]["output_token_ids_logprob"][0]
        assert [t[1] for t in sel] == labels
        lp = np.array([t[0] for t in sel], dtype=np.float64)
        ref = np.exp(lp - lp.max()) / np.exp(lp - lp.max()).sum()
        assert sum(soft["scores"][k]) == pytest.approx(1.0, abs=1e-9)
        np.testing.assert_allclose(soft["scores"][k], ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(raw["scores"][k], np.exp(lp), rtol=1e-5, atol=1e-9)
        assert sum(raw["scores"][k]) < 1.0 + 1e-9
    # item_first puts the item before the query: a different prompt, different scores.
    first = h.post("/v1/score", json={**body, "apply_softmax": True, "item_first": True}).json()
    assert first["scores"] != soft["scores"]


def test_health_info_and_models(served, idle_engine):
    h = served.http
    assert h.get("/health").json() == {"status": "ok"}
    hg = h.get("/health_generate")
    assert hg.status_code == 200 and len(hg.json()["output_ids"]) == 1
    info = h.get("/get_model_info").json()
    assert info["served_model_name"] == served.engine.model_name
    assert info["is_generation"] is True and info["tokenizer_path"]
    st = h.get("/get_server_info").json()
    for key in ("engine_paused", "waiting_queue_size", "running_batch_size",
                "available_kv_tokens", "tree_cache_size", "forward_ct_decode",
                "weight_version", "internal_states", "model_path"):
        assert key in st
    # what the engine holds (engine/memory_report.py), and the process's resident memory
    mem = st["memory"]
    assert mem["weights_bytes"] > 0 and mem["kv_pool_tokens"] == st["max_total_tokens"]
    assert mem["kv_pool_bytes"] == (mem["kv_pool_tokens"] + mem["kv_pool_padding_tokens"]) \
        * mem["kv_bytes_per_token"]
    assert st["process_memory"]["rss_bytes"] > mem["weights_bytes"] + mem["kv_pool_bytes"]
    assert h.get("/v1/models").json()["data"][0]["id"] == served.engine.model_name


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_are_per_app_and_count_traffic(served, idle_engine):
    from multiserve.server import ServerThread, build_app

    h = served.http
    before = _families(h.get("/metrics").text)
    r = h.post("/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200
    h.post("/generate", json={"text": "Hi", "sampling_params": {"temperature": -1}})
    fams = _families(h.get("/metrics").text)

    def value(fams, name, **labels):
        for s in fams[name].samples:
            if s.name.endswith("_total") or s.name == name:
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    assert value(fams, "multiserve_generation_tokens") - \
        value(before, "multiserve_generation_tokens") == 3
    assert value(fams, "multiserve_prompt_tokens") > value(before, "multiserve_prompt_tokens")
    assert value(fams, "multiserve_http_requests", endpoint="/generate", status="400") >= 1
    assert value(fams, "multiserve_http_requests", endpoint="/generate", status="200") >= 1
    assert value(fams, "multiserve_requests_finished", finish_reason="length") >= 1
    ttft = {s.name: s.value for s in fams["multiserve_time_to_first_token_seconds"].samples}
    assert ttft["multiserve_time_to_first_token_seconds_count"] >= 1
    gauges = {f: fams[f].samples[0].value for f in (
        "multiserve_num_running_reqs", "multiserve_num_waiting_reqs", "multiserve_engine_paused",
        "multiserve_kv_cache_usage", "multiserve_kv_available_tokens")}
    assert gauges["multiserve_engine_paused"] == 0 and gauges["multiserve_num_running_reqs"] == 0
    assert 0.0 <= gauges["multiserve_kv_cache_usage"] <= 1.0
    # A second app for the same engine in the same process has its own registry.
    with ServerThread(build_app(served.engine, served.tm)) as other:
        import httpx

        fresh = _families(httpx.get(other.url + "/metrics").text)
        assert value(fresh, "multiserve_generation_tokens") == 0


class _UnhealthyView:
    """The real engine, seen through a health() that reports a fault (503 path)."""

    def __init__(self, engine):
        self._engine = engine
        self.model_name = engine.model_name
        self.context_len = engine.context_len

    def health(self):
        return False, "device fault (test)"

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_unhealthy_engine_answers_503_with_reason(served, idle_engine):
    import httpx

    from multiserve.server import ServerThread, build_app

    with ServerThread(build_app(_UnhealthyView(served.engine), served.tm)) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "device fault" in r.json()["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": served.engine.model_name, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "device fault" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health_generate").status_code == 503


def test_health_says_asleep_while_memory_released(served, idle_engine):
    eng = served.engine
    assert eng.release_memory_occupation(tags=("kv_cache",)).ok
    try:
        r = served.http.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "asleep", r.text
        assert "kv_cache" in r.json()["message"]
        # a request sent while asleep is queued, not lost, and completes after resume
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(served.http.post, "/generate", json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True}})
            served.wait_state(lambda st: st["waiting_queue_size"] == 1)
            assert eng.resume_memory_occupation(tags=("kv_cache",)).ok
            out = fut.result(timeout=120)
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 3
    finally:
        eng.resume_memory_occupation(tags=("kv_cache",))
    assert served.http.get("/health").json()["status"] == "ok"


def test_refused_streaming_request_gets_an_http_error_not_a_broken_stream(served, idle_engine):
    """The engine accepts (or refuses) a streaming request before the response starts:
    a client never sees 200 and then an error event for a request that never ran."""
    h = served.http
    served.engine.pause_generation("in_place")  # keeps the first request live
    try:
        with ThreadPoolExecutor(1) as pool:
            live = pool.submit(h.post, "/generate", json={
                "text": "Hi", "rid": "dup-stream",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            served.wait_state(lambda st: st["waiting_queue_size"] == 1)
            r = h.post("/generate", json={"text": "Hi", "rid": "dup-stream", "stream": True,
                                          "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "rid"
            served.engine.continue_generation()
            assert live.result(timeout=120).status_code == 200
    finally:
        served.engine.continue_generation()


class _WrongDrafts:
    """Drafts that are always wrong (token 0, k of them): every decode verifies a draft."""

    def wants(self, req): return True  # noqa: ANN001, ANN201, E704
    def propose(self, req, k): return (0,) * k  # noqa: ANN001, ANN201, E704
    def acceptance(self, req): return 1.0  # noqa: ANN001, ANN201, E704
    def record(self, req, proposed, accepted): pass  # noqa: ANN001, ANN201, E704
    def finished(self, req): pass  # noqa: ANN001, ANN201, E704


def test_speculation_counts_in_meta_info_metrics_and_server_info(served, idle_engine):
    """With a draft source, /generate's meta_info counts its verify rows and accepted
    tokens (sglang's spec_verify_ct), /metrics the engine's totals, and the text is the
    text without speculation."""
    from multiserve.engine.commands import Call

    def drafts(source):  # noqa: ANN001, ANN202
        served.engine.call(Call(lambda core: core.scheduler.planner.set_source(source))
                           ).result()

    body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True}}
    plain = served.http.post("/generate", json=body).json()
    assert plain["meta_info"]["spec_verify_ct"] == 0
    drafts(_WrongDrafts())
    try:
        spec = served.http.post("/generate", json=body).json()
    finally:
        drafts(None)
    assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
    assert spec["meta_info"]["spec_verify_ct"] > 0
    assert 0 <= spec["meta_info"]["spec_accepted_tokens"] < 12
    metrics = served.http.get("/metrics").text
    assert "multiserve_spec_verify_steps" in metrics
    info = served.state()
    assert info["speculative_algorithm"] is None and info["spec_verify_ct"] > 0
