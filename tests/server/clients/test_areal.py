"""AReaL (inclusionAI/AReaL areal/engine/sglang_remote.py, RemoteSGLangEngine) against
the engine ports, unchanged: its /generate payload and interruption loop (a request
aborted by /pause_generation is resent with the tokens so far appended), and its weight
update: POST /pause_generation (no body) on every server, POST /update_weights_from_disk
{"model_path", "abort_all_requests": true}, POST /continue_generation (no body).

Issue 10 item shown here: 1 (sglang's /update_weights_from_disk body, on every engine and
on the supervisor: weight_version optional, abort_all_requests, load_format, flush_cache,
unknown keys ignored).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from client_helpers import Live

PROMPT = [1, 77, 5021, 309, 4410, 21, 8, 1999]
TOP_K_OFF = 100_000_000  # AReaL's default top_k (GenerationHyperparameters)


def sample_params(max_new: int, greedy: bool = True) -> dict[str, Any]:
    return {"top_p": 1.0, "top_k": TOP_K_OFF, "max_new_tokens": max_new,
            "temperature": 0.0 if greedy else 1.0, "stop_token_ids": [2],
            "frequency_penalty": 0.0}


def agenerate(live: Live, addr: str, input_ids: list[int], max_new: int,
              paused: threading.Event) -> tuple[list[int], list[float], str, int]:
    """RemoteSGLangEngine.agenerate's loop: (tokens, logprobs, stop reason, requests)."""
    params = sample_params(max_new)
    payload = {"input_ids": list(input_ids), "image_data": None, "sampling_params": params,
               "return_logprob": True, "stream": False}
    tokens: list[float] = []
    logprobs: list[float] = []
    stop_reason, sent = None, 0
    while stop_reason not in ("stop", "tool_calls", "length") and len(tokens) < max_new:
        while paused.is_set():
            time.sleep(0.01)
        r = live.http.post(f"{addr}/generate", json=payload)
        sent += 1
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        stop_reason = meta["finish_reason"]["type"]
        if stop_reason == "abort" and meta["finish_reason"].get("message") == \
                "Abort before prefill":
            continue
        out = [x[1] for x in meta["output_token_logprobs"]]
        tokens += out
        logprobs += [x[0] for x in meta["output_token_logprobs"]]
        payload["input_ids"] += out
        params["max_new_tokens"] -= len(out)
    return tokens, logprobs, stop_reason or "", sent  # type: ignore[return-value]


def update_weights(live: Live, path: str, payload: dict[str, Any]) -> None:
    """RemoteSGLangEngine.update_weights (disk): pause all, update all, continue all."""
    for addr in live.urls:
        live.http.post(f"{addr}/pause_generation").raise_for_status()
    for addr in live.urls:
        r = live.http.post(f"{addr}/update_weights_from_disk",
                           json={"model_path": path, **payload})
        assert r.status_code == 200, r.text
        assert r.json()["success"] is True
    for addr in live.urls:
        live.http.post(f"{addr}/continue_generation").raise_for_status()


def test_generate_interrupted_by_a_weight_update_resumes_where_it_stopped(live: Live) -> None:
    """The loop's answer is what one uninterrupted greedy run gives (tokens and logprobs)
    when AReaL's update (pause, abort_all_requests, continue) lands mid-request and
    reloads the same weights: the aborted request is resent with its tokens appended."""
    never = threading.Event()
    ref, ref_lps, reason, sent = agenerate(live, live.url, PROMPT, 160, never)
    assert (len(ref), reason, sent) == (160, "length", 1)

    paused = threading.Event()
    result: list[Any] = []
    worker = threading.Thread(
        target=lambda: result.append(agenerate(live, live.url, PROMPT, 160, paused)))
    worker.start()
    # freeze the request mid-way (an in-place pause keeps it, with its tokens), so that
    # AReaL's update surely finds it running
    start = live.state()["forward_ct"]
    live.wait_state(lambda s: s["running_batch_size"] == 1 and s["forward_ct"] >= start + 8)
    live.http.post(f"{live.url}/pause_generation", json={"mode": "in_place"})
    assert live.state()["running_batch_size"] == 1, "the request ended before the pause"
    paused.set()  # AReaL's executor pauses its workflows, then updates the weights
    update_weights(live, str(live.base), {"abort_all_requests": True})
    paused.clear()
    worker.join(120)
    tokens, lps, reason, sent = result[0]
    assert sent == 2, "the update did not interrupt the request once"
    assert reason == "length" and tokens == ref and lps == ref_lps
    versions = {live.http.get(f"{u}/get_weight_version").json()["weight_version"]
                for u in live.urls}
    assert len(versions) == 4 and "base" not in versions  # a new version per engine
    fleet = live.http.get(f"{live.supervisor}/get_weight_version").json()  # item 2
    assert fleet["agree"] is False and fleet["weight_version"] is None
    assert {e["weight_version"] for e in fleet["engines"]} == versions


def test_update_weights_from_disk_sglang_bodies(live: Live) -> None:
    """Item 1, one engine port: the bodies AReaL sent over time and the rest of sglang's
    UpdateWeightFromDiskReqInput keys; `weight_version` absent -> a new version."""
    h, url = live.http, live.url
    before = h.post(f"{url}/generate", json={"input_ids": PROMPT,
                                             "sampling_params": sample_params(16)}).json()
    # an older AReaL spelled the flag `abort_all_request` (sglang ignores unknown keys)
    update_weights(live, str(live.perturbed), {"abort_all_request": True})
    version = h.get(f"{url}/get_weight_version").json()["weight_version"]
    assert version.startswith("tiny-perturbed-")
    after = h.post(f"{url}/generate", json={"input_ids": PROMPT,
                                            "sampling_params": sample_params(16)}).json()
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == version
    for body in ({"model_path": str(live.base), "weight_version": "v-explicit",
                  "load_format": "auto", "flush_cache": True, "is_async": False,
                  "torch_empty_cache": True, "recapture_cuda_graph": False, "token_step": 3,
                  "keep_pause": False, "rid": "ignored-by-sglang"},
                 {"model_path": str(live.base), "load_format": None, "flush_cache": False}):
        r = h.post(f"{url}/update_weights_from_disk", json=body)
        assert r.status_code == 200 and r.json()["success"], r.text
    assert "flush_cache=false is not honoured" in r.json()["message"]
    back = h.post(f"{url}/generate", json={"input_ids": PROMPT,
                                           "sampling_params": sample_params(16)}).json()
    assert back["output_ids"] == before["output_ids"]
    for bad, param in (({"model_path": str(live.base), "load_format": "gguf"}, "load_format"),
                       ({}, "model_path"),
                       ({"model_path": str(live.base), "manifest": {"a": 1}}, "manifest"),
                       ({"model_path": str(live.base), "flush_cache": "yes"}, "flush_cache")):
        r = h.post(f"{url}/update_weights_from_disk", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_update_weights_from_disk_on_the_supervisor(live: Live) -> None:
    """Item 1, fleet-wide: the same body to the supervisor; without weight_version every
    engine gets the same new version; abort_all_requests aborts what runs."""
    h, sup = live.http, live.supervisor
    result: dict[str, Any] = {}
    h.post(f"{live.urls[1]}/pause_generation", json={"mode": "in_place"})
    worker = threading.Thread(target=lambda: result.update(h.post(
        f"{live.urls[1]}/generate", json={"input_ids": PROMPT,
                                          "sampling_params": sample_params(50)}).json()))
    worker.start()
    live.wait_state(lambda s: s["waiting_queue_size"] == 1, live.urls[1])
    r = h.post(f"{sup}/update_weights_from_disk",
               json={"model_path": str(live.perturbed), "abort_all_requests": True,
                     "load_format": "safetensors", "unknown_future_key": {"x": 1}})
    assert r.status_code == 200 and r.json()["success"], r.text
    worker.join(60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    fleet = h.get(f"{sup}/get_weight_version").json()
    assert fleet["agree"] is True and fleet["weight_version"] == r.json()["weight_version"]
    assert fleet["weight_version"].startswith("tiny-perturbed-")
    r = h.post(f"{sup}/update_weights_from_disk", json={"model_path": str(live.base),
                                                        "load_format": "dummy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format"
