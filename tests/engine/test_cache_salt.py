"""Prefix-cache isolation by key (issue 63 item 2): vLLM's cache_salt / SGLang's extra_key
reach the engine as `GenerateRequest.cache_salt`. Requests with different keys never
share a cached page, requests with the same key share as unkeyed ones do, and the outputs
(ids and logprobs) are the same bits with or without a hit, keyed or not."""

from __future__ import annotations

from typing import Any

import pytest

from multiserve.types import GenerateRequest, InvalidRequest, SamplingParams, cache_namespace

PROMPT = tuple(range(5, 5 + 70))  # > 4 pages of 16
PARAMS = (SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                         return_logprob=True),
          SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=12,
                         ignore_eos=True, return_logprob=True))


def _run(engine: Any, rid: str, params: SamplingParams, salt: str | None) -> Any:
    *_, last = engine.stream_sync(GenerateRequest(rid=rid, input_ids=PROMPT, sampling=params,
                                                  cache_salt=salt))
    return last


def _bits(out: Any) -> tuple:
    return out.output_ids, tuple(t.logprob for t in out.logprobs)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_keys_isolate_and_share_and_never_change_bits(tiny_engine: Any,
                                                      params: SamplingParams) -> None:
    assert tiny_engine.flush_cache().ok
    first = _run(tiny_engine, "a", params, None)
    runs = [("b", None), ("c", "v1"), ("d", "v1"), ("e", "v2"), ("f", None)]
    got = {rid: _run(tiny_engine, rid, params, salt) for rid, salt in runs}
    assert first.cached_tokens == 0
    assert got["b"].cached_tokens > 0  # unkeyed requests share, as before
    assert got["c"].cached_tokens == 0  # a new key sees nothing of the unkeyed pages
    assert got["d"].cached_tokens == got["b"].cached_tokens  # the same key shares
    assert got["e"].cached_tokens == 0  # another key sees nothing of v1's
    assert got["f"].cached_tokens == got["b"].cached_tokens
    assert all(_bits(o) == _bits(first) for o in got.values())


def test_an_empty_salt_is_refused(tiny_engine: Any) -> None:
    with pytest.raises(InvalidRequest, match="cache_salt") as e:
        _run(tiny_engine, "x", PARAMS[0], "")
    assert e.value.param == "cache_salt"


def test_namespaces_of_two_fields_never_collide() -> None:
    assert cache_namespace(None, None) is None and cache_namespace("", None) is None
    assert cache_namespace("ab", "c") != cache_namespace("a", "bc")
    assert cache_namespace("a", None) != cache_namespace(None, "a")
