"""AReaL's vLLM backend (inclusionAI/AReaL areal/engine/vllm_remote.py, VLLMBackend, driven
by areal/infra/remote_inf_engine.py) against the engine ports, unchanged: its flat
/v1/completions payload (prompt ids, return_tokens_as_token_ids, logprobs 0, parsed back
from "token_id:<id>"), its pause (POST /areal_pause_generation {} on every server: its vLLM
server aborts everything and clears the cache, as vLLM's /pause?mode=abort does) and
continue (POST /areal_continue_generation {}), and its loop resubmitting an aborted
request with the tokens so far appended. Issue 63 item 1 as AReaL calls it."""

from __future__ import annotations

import threading
import time
from typing import Any

from client_helpers import Live

PROMPT = [1, 77, 5021, 309, 4410, 21, 8, 1999]


def payload(input_ids: list[int], max_new: int) -> dict[str, Any]:
    """VLLMBackend.build_generation_request (greedy, no LoRA, text prompt as ids)."""
    return {"top_p": 1.0, "top_k": 100_000_000, "max_tokens": max_new, "temperature": 0.0,
            "stop_token_ids": [2], "ignore_eos": False, "skip_special_tokens": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False,
            "stream": False, "prompt": list(input_ids)}


def agenerate(live: Live, addr: str, max_new: int, paused: threading.Event
              ) -> tuple[list[int], list[float], str, int]:
    """RemoteInfEngine.agenerate's loop: (tokens, logprobs, stop reason, requests sent)."""
    ids, tokens, lps, reason, sent = list(PROMPT), [], [], None, 0
    left = max_new
    while reason not in ("stop", "tool_calls", "length") and len(tokens) < max_new:
        while paused.is_set():
            time.sleep(0.01)
        r = live.http.post(f"{addr}/v1/completions", json=payload(ids, left))
        sent += 1
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        reason = choice["finish_reason"]
        out = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        tokens += out
        lps += choice["logprobs"]["token_logprobs"]
        ids += out
        left -= len(out)
    return tokens, lps, reason or "", sent


def test_pause_mid_request_then_continue_resumes_where_it_stopped(live: Live) -> None:
    never = threading.Event()
    ref, ref_lps, reason, sent = agenerate(live, live.url, 160, never)
    assert (len(ref), reason, sent) == (160, "length", 1)
    paused = threading.Event()
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(
        agenerate(live, live.url, 160, paused)))
    start = live.state()["forward_ct"]
    worker.start()
    live.wait_state(lambda s: s["running_batch_size"] == 1 and s["forward_ct"] >= start + 8)
    paused.set()  # RemoteInfEngine.pause_generation: the workflows wait, the servers abort
    for url in live.urls:
        r = live.http.post(f"{url}/areal_pause_generation", json={})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert live.http.get(f"{live.url}/is_paused").json() == {"is_paused": True}
    for url in live.urls:
        r = live.http.post(f"{url}/areal_continue_generation", json={})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    paused.clear()
    worker.join(120)
    tokens, lps, reason, sent = result[0]
    assert sent == 2, "the pause did not interrupt the request once"
    assert reason == "length" and tokens == ref and lps == ref_lps
