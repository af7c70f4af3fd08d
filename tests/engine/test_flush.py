"""flush_cache on the tiny engine (issue 4): what it resets, that it changes no output, and
that it is refused, naming the blocker, while anything is waiting, running or chunked.
"""

from __future__ import annotations

import random
from typing import Any

from engine_helpers import TINY_VOCAB, AtTokens, Collector, Trigger, held

from multiserve.engine.commands import CheckIntegrity
from multiserve.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def _work() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(9)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (1, 9, 30)]
    prompts.append([rng.randrange(3, TINY_VOCAB) for _ in range(70)])
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_new_tokens=16,
                                     ignore_eos=True), GREEDY, GREEDY.with_updates(n=2)]
    return prompts, params


def _generate(engine: Any) -> dict:
    col = Collector(engine)
    prompts, params = _work()
    col.submit_all(prompts, params)
    return {k: o.output_ids for k, o in col.wait().items()}


def _assert_flushed(engine: Any, res: Any, cached_before: int) -> None:
    assert res.ok, res
    assert res.details["flushed_cached_tokens"] == cached_before
    st = engine.get_internal_state()
    assert st["available_kv_tokens"] == st["initial_available_kv_tokens"]
    assert st["tree_cache_size"] == 0 and st["evictable_kv_tokens"] == 0
    assert st["req_to_token_pool_used"] == 0
    assert st["forward_ct_decode"] == 0
    assert st["new_token_ratio"] == engine.config.init_new_token_ratio
    assert st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0
    assert not st["cur_batch"] and not st["last_batch"] and not st["chunked_req"]
    engine.call(CheckIntegrity()).result()


def test_flush_after_generation_resets_everything(tiny_engine: Any) -> None:
    first = _generate(tiny_engine)
    st = tiny_engine.get_internal_state()
    assert st["tree_cache_size"] > 0 and st["forward_ct_decode"] > 0 and st["last_batch"]
    assert st["new_token_ratio"] != tiny_engine.config.init_new_token_ratio
    _assert_flushed(tiny_engine, tiny_engine.flush_cache(), st["tree_cache_size"])
    assert _generate(tiny_engine) == first  # generation after a flush is unchanged


def test_five_generate_flush_cycles(tiny_engine: Any) -> None:
    tiny_engine.flush_cache()
    first = _generate(tiny_engine)
    for _ in range(5):
        cached = tiny_engine.get_internal_state()["tree_cache_size"]
        _assert_flushed(tiny_engine, tiny_engine.flush_cache(), cached)
        assert _generate(tiny_engine) == first


def test_flush_refused_while_busy_names_the_blocker(tiny_engine: Any,
                                                   trigger: Trigger) -> None:
    rng = random.Random(3)
    short = [rng.randrange(3, TINY_VOCAB) for _ in range(4)]
    long = [rng.randrange(3, TINY_VOCAB) for _ in range(400)]  # 13 chunks of <= 32 tokens
    hook = AtTokens(trigger, "decoding", 2, lambda: tiny_engine.acontrol(
        "pause_generation", mode="in_place"))
    col = Collector(tiny_engine, on_output=hook)
    with held(tiny_engine):
        col.submit("decoding", short, GREEDY.with_updates(max_new_tokens=64))
        col.submit("chunked", long, GREEDY)
    hook.wait()
    st = tiny_engine.get_internal_state()
    assert st["chunked_req"] and st["running_batch_size"] == 2

    res = tiny_engine.flush_cache()
    assert not res.ok and "running" in res.message and "chunked" in res.message
    assert tiny_engine.abort_request("decoding").ok
    res = tiny_engine.flush_cache()
    assert not res.ok and "chunked" in res.message and "running" not in res.message

    retract = AtTokens(trigger, "chunked", 2, lambda: tiny_engine.acontrol(
        "pause_generation", mode="retract"))
    col.on_output = retract
    assert tiny_engine.continue_generation().ok
    retract.wait()  # the long request is back in the waiting queue
    cached = tiny_engine.get_internal_state()["tree_cache_size"]
    res = tiny_engine.flush_cache()
    assert not res.ok and "waiting" in res.message and "running" not in res.message
    assert tiny_engine.get_internal_state()["tree_cache_size"] == cached  # nothing flushed
    assert tiny_engine.continue_generation().ok
    got = col.wait()
    assert got[("decoding", 0)].finish_reason == "abort"
    assert got[("chunked", 0)].finish_reason == "length"


def test_flush_while_paused_and_idle_is_allowed(tiny_engine: Any) -> None:
    _generate(tiny_engine)
    assert tiny_engine.pause_generation("in_place").ok
    cached = tiny_engine.get_internal_state()["tree_cache_size"]
    res = tiny_engine.flush_cache()
    assert res.ok and res.details["flushed_cached_tokens"] == cached
    assert tiny_engine.get_internal_state()["engine_paused"]
    assert tiny_engine.continue_generation().ok


def test_internal_state_fields_and_step_counters(tiny_engine: Any) -> None:
    st = tiny_engine.get_internal_state()
    for name in ("engine_paused", "waiting_queue_size", "running_batch_size", "running_rids",
                 "waiting_rids", "available_kv_tokens", "tree_cache_size",
                 "req_to_token_pool_used", "forward_ct_decode", "new_token_ratio",
                 "cur_batch", "last_batch", "chunked_req", "cache_miss_count",
                 "weight_version"):
        assert name in st, name
    assert tiny_engine.flush_cache().ok
    before = tiny_engine.get_internal_state()["forward_ct"]
    out = tiny_engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY.with_updates(
        max_new_tokens=8))
    assert out.completion_tokens == 8
    st = tiny_engine.get_internal_state()
    # One prefill step (samples token 1), then exactly one decode step per further token:
    # overlap never launches a step for a token the request does not need.
    assert st["forward_ct"] - before == 8 and st["forward_ct_decode"] == 7
