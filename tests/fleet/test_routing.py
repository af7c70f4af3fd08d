"""The front door's routing policy (fleet/routing.py), on its own: sticky by session, else
the longest prefix when it covers enough and the load is balanced, else least loaded; the
prompt key's namespaces. Jax-free, no server."""

from __future__ import annotations

import pytest

from multiserve.config import ConfigError, RoutingConfig
from multiserve.fleet.front_door import prompt_key, session_of
from multiserve.fleet.routing import Router, prefix_chain

ALL = [0, 1, 2, 3]
LONG = "x" * 640  # 10 chunks of 64


def test_sticky_then_repinned_when_its_engine_cannot_take_work() -> None:
    r = Router(4)
    first = r.choose(ALL, "a" * 100, "s1")
    assert first.reason == "least_loaded" and r.sessions["s1"] == first.engine
    r.done(first.engine)
    assert r.choose(ALL, "b" * 100, "s1").engine == first.engine
    assert r.stats.by_reason["sticky"] == 1
    others = [i for i in ALL if i != first.engine]
    moved = r.choose(others, "c" * 100, "s1")
    assert moved.engine in others and moved.reason != "sticky"
    assert r.sessions["s1"] == moved.engine and r.stats.repinned == 1
    assert sum(r.pinned) == 1 and r.pinned[moved.engine] == 1
    assert r.finish_session("s1") and not r.finish_session("s1") and sum(r.pinned) == 0


def test_prefix_follows_a_longer_prompt_if_it_covers_the_threshold() -> None:
    r = Router(4)
    first = r.choose(ALL, LONG, None)
    r.done(first.engine)
    longer = r.choose(ALL, LONG + "y" * 64, None)
    assert (longer.engine, longer.reason) == (first.engine, "prefix")
    assert longer.matched_chars == len(LONG)
    r.done(longer.engine)
    # a prompt that shares less than cache_threshold (0.3) of itself: the least loaded
    other = r.choose(ALL, LONG[:64] + "z" * 600, None)
    assert other.reason == "least_loaded"


def test_no_preference_when_every_engine_has_the_prefix() -> None:
    r = Router(2)
    for e in (0, 1):
        r.indexes[e].insert(prefix_chain(LONG, 64))
    r.in_flight = [3, 0]
    assert r.choose([0, 1], LONG + "q" * 64, None).engine == 1


@pytest.mark.parametrize("loads, want", [([5, 0], (1, "least_loaded")),  # 5 > 2 + 0
                                         ([2, 1], (0, "prefix")),  # within 2
                                         ([9, 7], (0, "prefix"))])  # 9 <= 7 * 1.5
def test_imbalance_beats_the_prefix(loads: list[int], want: tuple) -> None:
    r = Router(2, RoutingConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    r.indexes[0].insert(prefix_chain(LONG, 64))
    r.in_flight = loads
    d = r.choose([0, 1], LONG, None)
    assert (d.engine, d.reason) == want


def test_least_loaded_counts_in_flight_then_pinned_sessions() -> None:
    r = Router(3)
    r.in_flight = [1, 0, 0]
    r.pinned = [0, 2, 1]
    assert r.choose([0, 1, 2], "k", None).engine == 2


def test_sessions_are_bounded_and_pins_stay_counted() -> None:
    r = Router(2, RoutingConfig(max_sessions=3))
    for i in range(5):
        d = r.choose([0, 1], f"p{i}", f"s{i}")
        r.done(d.engine)
    assert list(r.sessions) == ["s2", "s3", "s4"] and sum(r.pinned) == 3


def test_prefix_chain_whole_chunks_only() -> None:
    assert prefix_chain("a" * 63, 64) == []
    assert len(prefix_chain("a" * 130, 64)) == 2
    assert prefix_chain("a" * 128, 64)[0] == prefix_chain("a" * 64 + "b" * 64, 64)[0]


def test_prompt_keys_keep_cache_namespaces_apart() -> None:
    msgs = [{"role": "user", "content": "hi " * 50}]
    plain = prompt_key("/v1/chat/completions", {"messages": msgs})
    salted = prompt_key("/v1/chat/completions", {"messages": msgs, "cache_salt": "v1"})
    assert prefix_chain(plain, 64)[0] != prefix_chain(salted, 64)[0]
    two = prompt_key("/v1/chat/completions", {"messages": msgs + [{"role": "user",
                                                                  "content": "more"}]})
    assert two[:len(plain) - 2] == plain[:-2]  # a longer conversation extends the key
    assert prompt_key("/generate", {"input_ids": [[1, 2], [3]]}) == \
        prompt_key("/generate", {"input_ids": [1, 2]})
    assert prompt_key("/generate", "not an object") == ""
    assert session_of({"x-sgl-routing-key": "k"}) == "k" and session_of({}) is None
    assert session_of({"x-smg-routing-key": "m"}) == "m"


@pytest.mark.parametrize("bad", [{"cache_threshold": 1.5}, {"balance_rel_threshold": 0.5},
                                 {"chunk_chars": 0}, {"wait_s": -1}])
def test_bad_routing_config_names_the_field(bad: dict) -> None:
    with pytest.raises(ConfigError, match="routing."):
        RoutingConfig(**bad)
