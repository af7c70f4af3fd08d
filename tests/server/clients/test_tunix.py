"""tunix (google/tunix tunix/generate/sglang_jax_sampler.py) call shape, unchanged: one
batched generate with `input_ids` (one list per prompt, BOS/EOS framed by its tokenize)
and `sampling_params` as a LIST, one dict per prompt, each sglang-jax's
`SamplingParams.convert_to_dict()` (every field, nulls included, top_k "all" as 1 << 30,
`sampling_seed` per prompt) -- sent to /generate, and to Engine.generate in process.

Issue 10 items shown here: 6 (a list of sampling_params), 10 (a batch is admitted
atomically: an abort issued once the call is accepted aborts all of it).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from client_helpers import Live

from multiserve.engine.commands import Call

TOP_K_ALL = 1 << 30
BOS, EOS = 1, 2
PROMPTS = [[BOS, 4000, 12, 777, EOS], [BOS, 31, 9, 2222, 15, 640, EOS], [BOS, 8, EOS]]


def converted(max_steps: int, temperature: float = 0.0, multi_sampling: int = 1,
              seed: int | None = None) -> dict[str, Any]:
    """sglang-jax SamplingParams (defaults), updated as SglangJaxSampler.__call__ does,
    then convert_to_dict()."""
    d: dict[str, Any] = {
        "max_new_tokens": max_steps, "stop": None, "stop_token_ids": [EOS],
        "temperature": temperature, "top_p": 1.0, "top_k": TOP_K_ALL, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "min_new_tokens": 0, "regex": None, "n": multi_sampling, "json_schema": None,
        "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None,
        "logit_bias": None, "sampling_seed": None}
    if seed is not None:
        d["sampling_seed"] = seed
    return d


def generate(live: Live, input_ids: list[list[int]], sampling_params: Any) -> Any:
    r = live.http.post(f"{live.url}/generate",
                       json={"input_ids": input_ids, "sampling_params": sampling_params})
    assert r.status_code == 200, r.text
    return r.json()


def test_list_of_sampling_params_one_per_prompt(live: Live) -> None:
    """Item 6: greedy batch; per-prompt seeds (sampled) give each prompt what it gets
    alone with that seed; multi_sampling (n) repeats the samples per prompt."""
    outs = generate(live, PROMPTS, [converted(12) for _ in PROMPTS])
    assert len(outs) == len(PROMPTS)
    alone = [generate(live, [p], [converted(12)])[0] for p in PROMPTS]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in alone]
    assert all(isinstance(o["text"], str) for o in outs)

    seeded = [converted(12, temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
    outs = generate(live, PROMPTS, seeded)
    for p, sp, out in zip(PROMPTS, seeded, outs, strict=True):
        assert generate(live, [p], sp)[0]["output_ids"] == out["output_ids"]
    n2 = generate(live, PROMPTS, [converted(6, temperature=1.0, multi_sampling=2, seed=5)
                                  for _ in PROMPTS])
    assert len(n2) == 2 * len(PROMPTS) and [o["index"] for o in n2] == list(range(6))

    # a mismatched list is a 400 naming sampling_params, as sglang refuses it
    r = live.http.post(f"{live.url}/generate", json={
        "input_ids": PROMPTS, "sampling_params": [converted(4)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"
    r = live.http.post(f"{live.url}/generate", json={
        "input_ids": PROMPTS, "sampling_params": [converted(4), converted(4, multi_sampling=2),
                                                  converted(4)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"


def test_in_process_engine_generate_takes_the_same_call(live: Live) -> None:
    """Engine.generate(input_ids=[...], sampling_params=[dict per prompt]) as tunix calls
    sglang-jax's Engine: the same outputs as the HTTP batch."""
    engine = live.fleet.workers[0].engine
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[converted(8) for _ in PROMPTS])
    http = generate(live, PROMPTS, [converted(8) for _ in PROMPTS])
    assert [list(o.output_ids) for o in outs] == [o["output_ids"] for o in http]
    assert [o.text for o in outs] == [o["text"] for o in http]


def test_batched_generate_is_admitted_atomically(live: Live) -> None:
    """Item 10: a 16-prompt streamed /generate answers its headers only once the whole
    batch is in the engine; an abort_all issued then aborts every one of them."""
    prompts = [[BOS, 100 + i, 7, 4000 + i] for i in range(16)]
    params = converted(200, temperature=1.0, seed=3)
    params["ignore_eos"] = True
    finals: dict[int, dict[str, Any]] = {}
    headers = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{live.url}/generate", timeout=120, json={
                "input_ids": prompts, "sampling_params": params, "stream": True}) as r:
            assert r.status_code == 200
            headers.set()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out = json.loads(line[6:])
                    if out["meta_info"]["finish_reason"] is not None:
                        finals[out["index"]] = out

    worker = threading.Thread(target=run)
    worker.start()
    assert headers.wait(60)
    st = live.state()
    assert st["running_batch_size"] + st["waiting_queue_size"] == 16, st
    r = live.http.post(f"{live.url}/abort_request", json={"abort_all": True})
    assert r.status_code == 200
    worker.join(60)
    assert sorted(finals) == list(range(16))
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in finals.values()}
    assert reasons == {"abort"}, reasons

    # the same through Engine.submit_many: once it returns, every request is in the engine
    engine = live.fleet.workers[0].engine
    from multiserve.types import GenerateRequest, SamplingParams

    got: list[Any] = []
    reqs = [GenerateRequest(rid=f"atomic-{i}", input_ids=tuple(p),
                            sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.submit_many(reqs, [got.append] * len(reqs))
    live_rids = engine.call(Call(lambda core: sorted({r.rid for r in
                                                      core.scheduler.reqs.values()}))).result()
    assert live_rids == sorted(r.rid for r in reqs)
    engine.abort_request(abort_all=True)
    live.wait_state(lambda s: s["running_batch_size"] + s["waiting_queue_size"] == 0)
    assert {o.finish_reason for o in got if o.finished} == {"abort"}
