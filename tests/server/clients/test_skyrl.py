"""SkyRL (NovaSky-AI/SkyRL skyrl/backends/skyrl_train/inference_servers/
remote_inference_client.py, RemoteInferenceClient) against the fleet, unchanged: its data
plane through one router URL (here the fleet's front door): POST /inference/v1/generate
{sampling_params, model, token_ids, cache_salt?} with an X-Session-ID header, and POST
/finish_session?session_id=...; its control plane fanned out to every engine URL: POST
/pause?mode=keep&clear_cache=false (no body), POST /resume, vLLM's weight-transfer
handshake (/init_weight_transfer_engine {"init_info"}, /update_weights
{"update_info"}). Issue 63 items 1-4 as SkyRL calls them.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from client_helpers import Live

PROMPT = [1, 77, 5021, 309, 4410, 21, 8, 1999, 41, 7]


def generate(live: Live, session: str, max_tokens: int, cache_salt: str | None = None
             ) -> tuple[list[int], list[float], str, dict[str, str]]:
    """RemoteInferenceClient._generate_single: (token ids, logprobs, stop reason, headers)."""
    payload: dict[str, Any] = {"sampling_params": {"temperature": 0.0, "max_tokens": max_tokens,
                                                   "logprobs": 0, "ignore_eos": True},
                               "model": live.model_name, "token_ids": PROMPT}
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    r = live.http.post(f"{live.fleet.front_door_url}/inference/v1/generate", json=payload,
                       headers={"Content-Type": "application/json", "X-Session-ID": session})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["token_ids"], [x["logprob"] for x in choice["logprobs"]["content"]],
            choice["finish_reason"], dict(r.headers))


def call_all(live: Live, endpoint: str, json: Any = None,
             params: dict[str, str] | None = None) -> list[Any]:
    """RemoteInferenceClient._call_all_servers: POST to every engine URL."""
    out = []
    for url in live.urls:
        r = live.http.post(f"{url}{endpoint}", json=json, params=params)
        assert r.status_code == 200, (url, endpoint, r.text)
        out.append(r.json())
    return out


def test_keep_pause_around_a_weight_sync_continues_bit_for_bit(live: Live) -> None:
    """SkyRL's weight sync: pause(keep) on every server, the transfer, resume. The frozen
    request finishes as if never paused (the same weights are pushed: same bits)."""
    session = f"traj-{uuid.uuid4().hex}"
    ref, ref_lps, reason, headers = generate(live, session, 160)
    assert reason == "length" and len(ref) == 160
    url = live.urls[int(headers["x-routed-engine"])]
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(generate(live, session, 160)))
    start = live.state(url)["forward_ct"]
    worker.start()
    live.wait_state(lambda s: s["running_batch_size"] == 1 and s["forward_ct"] >= start + 8,
                    url)
    paused = call_all(live, "/pause", params={"mode": "keep", "clear_cache": "false"})
    assert all(p["status"] == "paused" for p in paused)
    assert all(live.http.get(f"{u}/is_paused").json() == {"is_paused": True}
               for u in live.urls)
    assert live.state(url)["running_batch_size"] == 1, "the request ended before the pause"
    # vLLM's native transfer, disk backend (SkyRL's NCCL and IPC ones are refused below)
    assert all(a["backend"] == "disk" for a in call_all(
        live, "/init_weight_transfer_engine", json={"init_info": {}}))
    call_all(live, "/start_weight_update")
    call_all(live, "/update_weights", json={"update_info": {"path": str(live.base)}})
    done = call_all(live, "/finish_weight_update", json={"weight_version": "step-1"})
    assert {d["weight_version"] for d in done} == {"step-1"}
    assert live.state(url)["running_batch_size"] == 1  # still frozen, its K/V kept
    assert all(r["status"] == "resumed" for r in call_all(live, "/resume"))
    worker.join(120)
    tokens, lps, reason, _ = result[0]
    assert reason == "length" and tokens == ref and lps == ref_lps
    fin = live.http.post(f"{live.fleet.front_door_url}/finish_session",
                         params={"session_id": session})
    assert fin.status_code == 200 and fin.json()["released"] is True


def test_nccl_and_ipc_transfers_are_refused_with_a_400(live: Live) -> None:
    h, url = live.http, live.url
    nccl = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 2}
    for target in (url, live.supervisor):
        r = h.post(f"{target}/init_weight_transfer_engine", json={"init_info": nccl})
        assert r.status_code == 400 and "NCCL" in r.json()["error"]["message"], r.text
    assert h.post(f"{url}/init_weight_transfer_engine", json={}).status_code == 400
    assert h.post(f"{url}/pause", params={"mode": "abort"}).status_code == 200
    assert h.post(f"{url}/start_weight_update").status_code == 200
    for info in ({"names": ["model.embed_tokens.weight"], "dtype_names": ["bfloat16"],
                  "shapes": [[8, 4]], "packed": True},
                 {"names": ["w"], "sizes": [4], "ipc_handles": {"gpu-0": [1, 2]}}):
        r = h.post(f"{url}/update_weights", json={"update_info": info})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert h.post(f"{url}/abort_weight_update").json()["aborted"] is True
    assert h.post(f"{url}/resume").status_code == 200


def test_cache_salt_keys_the_cache_by_weight_version(live: Live) -> None:
    """SkyRL's use_cache_salt: the salt names the weight version; a new salt sees nothing
    of the old one's pages; the answer is the same bits."""
    session = f"salted-{uuid.uuid4().hex}"
    a = generate(live, session, 8, cache_salt="w0")
    b = generate(live, session, 8, cache_salt="w0")
    c = generate(live, session, 8, cache_salt="w1")
    assert a[:3] == b[:3] == c[:3]
    url = live.urls[int(a[3]["x-routed-engine"])]
    gen = {"input_ids": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}}
    hits = [live.http.post(f"{url}/generate", json={**gen, **k}).json()["meta_info"]
            ["cached_tokens"] for k in ({"extra_key": "s"}, {"extra_key": "s"}, {})]
    assert hits[0] == 0 and hits[1] > 0, hits


def test_fleet_wait_pause_and_weight_session_on_the_supervisor(live: Live) -> None:
    """The supervisor's spellings: /pause?mode=wait on every engine, the weight session on
    every engine under one version, /resume."""
    h, sup = live.http, live.supervisor
    r = h.post(f"{sup}/pause", params={"mode": "wait"})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    assert h.get(f"{sup}/is_paused").json()["is_paused"] is True
    assert h.post(f"{sup}/start_weight_update", json={}).status_code == 200
    bad = h.post(f"{sup}/update_weights", json={"update_info": {"path": "/no/such/dir"}})
    assert bad.status_code == 400 and bad.json()["aborted_after_failure"] == [0, 1, 2, 3]
    assert h.post(f"{sup}/start_weight_update", json={}).status_code == 200
    assert h.post(f"{sup}/update_weights",
                  json={"update_info": {"path": str(live.base)}}).status_code == 200
    done = h.post(f"{sup}/finish_weight_update", json={})
    assert done.status_code == 200, done.text
    version = done.json()["weight_version"]
    assert version.startswith("fleet-") and done.json()["engine_versions"] == [version]
    assert h.get(f"{sup}/get_weight_version").json()["weight_version"] == version
    assert h.post(f"{sup}/resume").json()["status"] == "resumed"
    assert h.get(f"{sup}/is_paused").json()["is_paused"] is False
