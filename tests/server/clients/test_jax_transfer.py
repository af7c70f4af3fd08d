"""SGLang's weights-update group with backend "jax": a JAX trainer in ANOTHER process (its
own jax, its own transfer server: jax_trainer.py) offers a checkpoint's tensors and the
fleet pulls them through /init_weights_update_group + /update_weights_from_distributed
(engine/rl/transfer.py). The engines then answer greedy requests bit for bit as after
/update_weights_from_disk of the same checkpoint, under the version the answer named; a
wrong shape or name is a 400 naming the tensor and the weights stay; destroy closes the
group; torch backends stay a 400. One engine's port serves the same calls (its own group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from client_helpers import Live

PROMPT = [1, 504, 3120, 88, 17, 4021, 933, 12]
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def greedy(live: Live, url: str) -> tuple[list[int], list[float]]:
    r = live.http.post(f"{url}/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], [item[0] for item in out["meta_info"]["output_token_logprobs"]]


def run_trainer(*args: str | Path) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "jax_trainer.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answers: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            answers.update(json.loads(line))
    return answers


def test_a_jax_trainer_in_another_process_updates_the_fleet(live: Live) -> None:
    h, sup = live.http, live.supervisor
    base = [greedy(live, u) for u in live.urls]
    # the fleet pulls the perturbed checkpoint (every engine, one version); then engine 0
    # alone, on its own port and group, pulls the base one back
    got = run_trainer(sup, live.perturbed, "jax-step-1",
                      live.url, live.base, "jax-e0-base", "e0")
    init, update = got["init"], got["update"]
    assert init["success"] is True and init["pulls_per_update"] == len(live.urls), init
    assert all(e["backend"] == "jax" for e in init["engines"]), init
    assert update["success"] is True and update["weight_version"] == "jax-step-1", update
    assert len(set(update["transfer_uuids"])) == len(live.urls), update
    assert got["init2"]["pulls_per_update"] == 1 and got["init2"]["group_name"] == "e0"
    assert got["update2"]["weight_version"] == "jax-e0-base", got["update2"]
    versions = [e["weight_version"] for e in h.get(f"{sup}/get_weight_version").json()[
        "engines"]]
    assert versions == ["jax-e0-base"] + ["jax-step-1"] * (len(live.urls) - 1), versions
    after = [greedy(live, u) for u in live.urls]
    assert after[0] == base[0]  # the base weights pulled back: the base bits
    pulled = after[1:]
    assert pulled != base[1:] and len(set(map(str, pulled))) == 1  # perturbed, alike
    # the same perturbed checkpoint from disk: the same bits as pulled
    r = h.post(f"{sup}/update_weights_from_disk",
               json={"model_path": str(live.perturbed), "weight_version": "jax-step-1"})
    assert r.status_code == 200, r.text
    pulled = [greedy(live, u) for u in live.urls]
    assert pulled[1:] == after[1:] and pulled[0] == after[1]

    # a wrong shape / an unknown name: 400 naming the tensor, nothing published (the
    # trainer is gone: the body is refused before any pull)
    name = "model.layers.0.self_attn.q_proj.weight"
    for url in (sup, live.url):
        for names, shapes, what in (([name], [[3, 5]], "shape"),
                                    (["model.no_such.weight"], [[4]], "not a parameter")):
            r = h.post(f"{url}/update_weights_from_distributed", json={
                "names": names, "dtypes": ["torch.float32"], "shapes": shapes,
                "weight_version": "never", "transfer_uuid": 7})
            assert r.status_code == 400, r.text
            assert what in r.text and "error" in r.json(), r.text
    assert h.get(f"{sup}/get_weight_version").json()["weight_version"] == "jax-step-1"
    assert [greedy(live, u) for u in live.urls] == pulled

    # destroy closes the group: an update of it is then a 400 that says so
    r = h.post(f"{sup}/destroy_weights_update_group", json={})
    assert r.status_code == 200 and all(e["destroyed"] for e in r.json()["engines"]), r.text
    r = h.post(f"{live.url}/destroy_weights_update_group", json={"group_name": "e0"})
    assert r.status_code == 200 and r.json()["destroyed"] is True, r.text
    r = h.post(f"{live.url}/update_weights_from_distributed", json={
        "names": [name], "dtypes": ["float32"], "shapes": [[4, 4]], "transfer_uuid": 7})
    assert r.status_code == 400 and "no weights update group" in r.text, r.text


def test_torch_backends_are_still_a_400(live: Live) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 2, "group_name": "g"}
    for url in (live.supervisor, live.url):
        for extra in ({}, {"backend": "nccl"}, {"backend": "gloo"}):
            r = live.http.post(f"{url}/init_weights_update_group", json={**body, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "backend_unsupported" and "torch" in err["message"], err
        # backend "jax" with a trainer address that does not resolve: refused by every
        # engine, none joined (all or none)
        r = live.http.post(f"{url}/init_weights_update_group", json={
            **body, "backend": "jax", "master_address": "no-such-host.invalid"})
        assert r.status_code == 400 and "no-such-host.invalid" in r.text, r.text
        if url == live.supervisor:
            assert r.json()["left_after_failure"] == [], r.text
        r = live.http.post(f"{url}/update_weights_from_distributed", json={
            "names": ["x"], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "g",
            "transfer_uuid": 1})
        assert r.status_code == 400 and "no weights update group" in r.text, r.text
