"""slime (THUDM/slime) against an engine port, unchanged: the exact JSON its rollout and
its SGLang engine wrapper send (slime/rollout/sglang_rollout.py, slime/backends/
sglang_utils/sglang_engine.py and server_control.py), and what they read back.

Issue 10 items shown here: 2 (GET /get_weight_version), 3 (memory tags as slime sends
them), 4 (/get_server_info keys slime's external-engine check compares), 5 (sampling_seed
= seed; unknown keys refused by name), 7 (no_stop_trim), plus slime's abort-until-idle
loop (/abort_request + /v1/loads).
"""

from __future__ import annotations

import threading
from typing import Any

from client_helpers import Live
from transformers import AutoTokenizer


def rollout_params(max_new: int, **over: Any) -> dict[str, Any]:
    """GenerateState.sampling_params as slime builds it (rollout_top_p 1.0 here; the
    `custom_params` top-p replay flag only when top_p != 1.0)."""
    params: dict[str, Any] = dict(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new, stop=None,
        stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
        spaces_between_special_tokens=False)
    params.update(over)
    return params


def generate(live: Live, ids: list[int], sampling_params: dict[str, Any],
             url: str | None = None) -> dict[str, Any]:
    """slime's `generate`: input_ids in, return_logprob, the session routing header."""
    r = live.http.post(f"{url or live.url}/generate",
                       json={"sampling_params": sampling_params, "return_logprob": True,
                             "input_ids": ids},
                       headers={"X-SMG-Routing-Key": "session-0"})
    assert r.status_code == 200, r.text
    out = r.json()
    # what slime reads
    toks = [item[1] for item in out["meta_info"]["output_token_logprobs"]]
    lps = [item[0] for item in out["meta_info"]["output_token_logprobs"]]
    assert toks == out["output_ids"] and all(isinstance(x, float) for x in lps)
    assert isinstance(out["text"], str)
    return out


PROMPT = [1, 504, 3120, 88, 17, 4021, 933, 12]


def test_startup_checks_and_server_info(live: Live) -> None:
    """_wait_server_healthy (GET /health_generate, then GET /flush_cache until 200) and
    the external-engine check (_sanity_check_server_args reads /get_server_info)."""
    h = live.http
    assert h.get(f"{live.url}/health_generate").status_code == 200
    assert h.get(f"{live.url}/flush_cache").status_code == 200
    for path in ("/get_server_info", "/server_info"):
        info = h.get(f"{live.url}{path}").json()
        # the server argument as set (default false, as sglang's): slime asserts it equals
        # its offload_rollout (false by default); memory release works either way
        # (test_memory_release_resume_as_slime_sends_it)
        assert info["enable_memory_saver"] is False
        assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == \
            (1, 1, 1, 1)
        assert (info["nnodes"], info["node_rank"]) == (1, 0)
        assert info["host"] == "127.0.0.1" and info["port"] == int(live.url.rsplit(":", 1)[1])
        assert info["base_gpu_id"] == 0 and info["gpu_id_step"] == 1
        assert info["weight_version"] == "base" and "internal_states" in info
    assert h.get(f"{live.supervisor}/get_server_info").json()["enable_memory_saver"] is False


def test_get_weight_version(live: Live) -> None:
    """SGLangEngine.get_weight_version: GET, `["weight_version"]`; the supervisor answers
    per engine and whether they agree."""
    for url in live.urls:
        r = live.http.get(f"{url}/get_weight_version")
        assert r.status_code == 200 and r.json() == {"weight_version": "base"}
    fleet = live.http.get(f"{live.supervisor}/get_weight_version").json()
    assert fleet["weight_version"] == "base" and fleet["agree"] is True
    assert [e["weight_version"] for e in fleet["engines"]] == ["base"] * 4


def test_rollout_generate_and_sampling_seed(live: Live) -> None:
    """Item 5: `sampling_seed` (slime's deterministic-inference seeds, rollout_seed + i)
    draws exactly what `seed` draws; every seed gives its own sample."""
    by_sglang = [generate(live, PROMPT, rollout_params(12, sampling_seed=42 + i))
                 for i in range(3)]
    by_seed = [generate(live, PROMPT, rollout_params(12, seed=42 + i)) for i in range(3)]
    again = generate(live, PROMPT, rollout_params(12, sampling_seed=42))
    for a, b in zip(by_sglang, by_seed, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert again["output_ids"] == by_sglang[0]["output_ids"]
    assert len({tuple(o["output_ids"]) for o in by_sglang}) == 3
    # top_p != 1.0: slime adds custom_params (read by a custom logit processor only)
    out = generate(live, PROMPT, rollout_params(
        8, top_p=0.9, sampling_seed=1, custom_params={"return_top_p_token_ids": True}))
    assert len(out["output_ids"]) == 8


def test_unknown_or_unsupported_sampling_keys_are_refused_by_name(live: Live) -> None:
    h = live.http
    for key, value in (("no_such_key", 1), ("json_schema", "{not json"), ("regex", "(["),
                       ("logit_bias", {"5": 1.0})):
        r = h.post(f"{live.url}/generate", json={
            "input_ids": PROMPT, "sampling_params": rollout_params(4, **{key: value}),
            "return_logprob": True})
        assert r.status_code == 400, (key, r.text)
        assert r.json()["error"]["param"] == key and key in r.json()["error"]["message"]
    r = h.post(f"{live.url}/generate", json={"input_ids": PROMPT, "sampling_params":
                                             rollout_params(4, sampling_seed=1, seed=2)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_seed"


def test_no_stop_trim_keeps_the_stop_string_and_token(live: Live) -> None:
    """Item 7: slime always sends no_stop_trim=true: the matched stop string (or stop
    token) stays in `text`; without it, SGLang trims it (stop strings from the text, a
    stop token from the text; output_ids keep the token either way)."""
    tok = AutoTokenizer.from_pretrained(live.base)
    greedy = dict(temperature=0.0, skip_special_tokens=True)
    ref = generate(live, PROMPT, rollout_params(24, **greedy))["output_ids"]
    pieces = [tok.decode([t], skip_special_tokens=True) for t in ref]

    def decoded(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # a stop token: the first output token whose id does not occur before it
    k = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i] and pieces[i].strip())
    for trim in (False, True):
        out = generate(live, PROMPT, rollout_params(
            24, **greedy, stop_token_ids=[ref[k]], no_stop_trim=not trim))
        assert out["output_ids"] == ref[:k + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[k]}
        assert out["text"] == decoded(ref[:k] if trim else ref[:k + 1])
    # a stop string: one token's text, first seen at token k
    full = decoded(ref)
    k = next(i for i in range(4, len(ref)) if len(pieces[i].strip()) >= 2
             and "\ufffd" not in pieces[i]
             and pieces[i] not in decoded(ref[:i]) + pieces[i][:-1])
    stop = pieces[k]
    for trim in (False, True):
        out = generate(live, PROMPT, rollout_params(24, **greedy, stop=[stop],
                                                    no_stop_trim=not trim))
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == ref[:k + 1]
        untrimmed = decoded(ref[:k + 1])
        assert out["text"] == (untrimmed[:untrimmed.index(stop)] if trim else untrimmed)
        assert full.startswith(out["text"])


def test_memory_release_resume_as_slime_sends_it(live: Live) -> None:
    """Item 3: release_memory_occupation({}) (everything), then multi-stage resume with
    tags ["weights"], ["kv_cache"], and sglang's "cuda_graph" tag (a no-op here)."""
    h, url = live.http, live.url
    assert h.get(f"{url}/flush_cache").status_code == 200
    r = h.post(f"{url}/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert set(live.state()["memory_released"]) == {"weights", "kv_cache"}
    r = h.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200 and live.state()["memory_released"] == ["kv_cache"]
    r = h.post(f"{url}/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]})
    assert r.status_code == 200 and r.json()["noop_tags"] == ["cuda_graph"]
    assert live.state()["memory_released"] == []
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = h.post(f"{url}{path}", json={"tags": ["cuda_graph"]})
        assert r.status_code == 200 and r.json()["success"] and "no-op" in r.json()["message"]
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):  # fleet-wide
        r = h.post(f"{live.supervisor}{path}", json={"tags": ["cuda_graph"]})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert all(e["noop_tags"] == ["cuda_graph"] for e in r.json()["engines"]), r.text
    r = h.post(f"{url}/resume_memory_occupation", json={"tags": None})  # slime's default
    assert r.status_code == 200
    r = h.post(f"{url}/release_memory_occupation", json={"tags": ["gpu_everything"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert len(generate(live, PROMPT, rollout_params(4))["output_ids"]) == 4


def test_pause_continue_and_abort_until_idle(live: Live) -> None:
    """pause_generation / continue_generation with json={} and slime's
    abort_servers_until_idle: POST /abort_request {"abort_all": true}, then
    GET /v1/loads?include=core,disagg,queues until no request is left."""
    h, url = live.http, live.url
    assert h.post(f"{url}/pause_generation", json={}).status_code == 200
    assert live.state()["engine_paused"] is True
    assert h.post(f"{url}/continue_generation", json={}).status_code == 200
    # a request left over from the rollout: held in the queue by an in-place pause, so
    # the load report is certain to see it
    assert h.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(generate(
        live, PROMPT, rollout_params(200, ignore_eos=True))))
    worker.start()

    def total(load: dict[str, Any]) -> int:
        return sum(rank["num_total_reqs"] for rank in load["loads"])

    live.wait_state(lambda s: s["waiting_queue_size"] == 1)
    load = h.get(f"{url}/v1/loads", params={"include": "core,disagg,queues"}).json()
    assert total(load) == 1 and load["loads"][0]["num_waiting_reqs"] == 1
    assert h.post(f"{url}/abort_request", json={"abort_all": True}).status_code == 200
    worker.join(60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert total(h.get(f"{url}/v1/loads").json()) == 0


def test_disk_weight_update_as_slime_sends_it(live: Live) -> None:
    """Item 1: SGLangEngine.update_weights_from_disk posts {"model_path",
    "torch_empty_cache": true, "weight_version"} (load_format only when given); its
    get_weight_version reads `weight_version` from GET /model_info (newer slime) or GET
    /get_weight_version (older)."""
    h, url = live.http, live.url
    for body, version in (({"model_path": str(live.perturbed), "torch_empty_cache": True,
                            "weight_version": "7"}, "7"),
                          ({"model_path": str(live.base), "torch_empty_cache": True,
                            "load_format": "auto", "weight_version": "8"}, "8")):
        r = h.post(f"{url}/update_weights_from_disk", json=body)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert h.get(f"{url}/model_info").json()["weight_version"] == version
        assert h.get(f"{url}/get_weight_version").json() == {"weight_version": version}
    out = generate(live, PROMPT, rollout_params(3))
    assert out["meta_info"]["weight_version"] == "8"
