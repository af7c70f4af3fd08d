"""One output path (issue 12, item 4): the engine emits token DELTAS, never a cumulative
snapshot; the consumer side (OutputAssembler, used by Engine.stream/generate and the
HTTP app) rebuilds the snapshot exactly."""

from __future__ import annotations

import queue
import random
import threading
from typing import Any

import pytest
from engine_helpers import TINY_VOCAB, WAIT_S

from multiserve.engine.streams import OutputAssembler
from multiserve.types import GenerateRequest, OutputDelta, SamplingParams, TokenLogprob

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True,
                        return_logprob=True, top_logprobs_num=2)


def _prompt(seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 40)))


def _deltas(engine: Any, rid: str, prompt: tuple[int, ...], params: SamplingParams,
            stream: bool) -> list[OutputDelta]:
    q: queue.SimpleQueue[OutputDelta] = queue.SimpleQueue()
    engine.submit(GenerateRequest(rid=rid, input_ids=prompt, sampling=params, stream=stream),
                  q.put)
    got: list[OutputDelta] = []
    while not (got and got[-1].finished):
        got.append(q.get(timeout=WAIT_S))
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_deltas_tile_the_output_and_assemble_to_what_generate_returns(
        tiny_engine: Any, stream: bool) -> None:
    prompt = _prompt(1)
    want = tiny_engine.generate(input_ids=list(prompt), sampling_params=PARAMS)
    deltas = _deltas(tiny_engine, f"deltas-{stream}", prompt, PARAMS, stream)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    at = 0
    for d in deltas:  # each delta starts where the previous one ended: nothing repeats
        assert d.start == at and d.new_logprobs is not None
        assert len(d.new_logprobs) == len(d.new_ids)
        at += len(d.new_ids)
    assert at == len(want.output_ids) == PARAMS.max_new_tokens
    if stream:  # one decode step, one token: the engine sends each token once
        assert all(len(d.new_ids) <= 1 for d in deltas)
    else:
        assert len(deltas) == 1
    assemble = OutputAssembler()
    outs = [assemble(d) for d in deltas]
    final = outs[-1]
    assert final.output_ids == want.output_ids and final.logprobs == want.logprobs
    assert final.finish_reason == want.finish_reason == "length"
    assert [len(o.output_ids) for o in outs] == sorted(len(o.output_ids) for o in outs)


def test_samples_of_one_request_assemble_separately(tiny_engine: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=True, n=3)
    want = tiny_engine.generate(input_ids=list(_prompt(2)), sampling_params=params)
    q: queue.SimpleQueue[OutputDelta] = queue.SimpleQueue()
    tiny_engine.submit(GenerateRequest(rid="deltas-n3", input_ids=_prompt(2), sampling=params,
                                       stream=True), q.put)
    assemble, finals = OutputAssembler(), {}
    while len(finals) < 3:
        out = assemble(q.get(timeout=WAIT_S))
        if out.finished:
            finals[out.index] = out.output_ids
    assert [finals[i] for i in range(3)] == [o.output_ids for o in want]


def test_the_assembler_refuses_a_gap_or_a_repeat() -> None:
    def delta(start: int, ids: tuple[int, ...], finished: bool = False) -> OutputDelta:
        return OutputDelta(rid="r", index=0, start=start, new_ids=ids, finished=finished,
                           finish_reason="length" if finished else None, prompt_tokens=3,
                           cached_tokens=0, weight_version="v",
                           new_logprobs=tuple(TokenLogprob(t, -1.0) for t in ids))

    assemble = OutputAssembler()
    assert assemble(delta(0, (7, 8))).output_ids == (7, 8)
    with pytest.raises(AssertionError, match="starts at 1"):
        assemble(delta(1, (9,)))  # a repeat of token 8
    out = assemble(delta(2, (9,), finished=True))
    assert out.output_ids == (7, 8, 9) and [lp.token_id for lp in out.logprobs] == [7, 8, 9]
    assert assemble(delta(0, (1,))).output_ids == (1,)  # a finished sample is forgotten


def test_stream_consumers_on_several_threads_see_whole_outputs(tiny_engine: Any) -> None:
    """Engine.stream_sync assembles per consumer; concurrent consumers do not mix."""
    prompts = [_prompt(10 + i) for i in range(4)]
    want = [tiny_engine.generate(input_ids=list(p), sampling_params=PARAMS).output_ids
            for p in prompts]
    got: dict[int, tuple[int, ...]] = {}

    def consume(i: int) -> None:
        req = GenerateRequest(rid=f"deltas-t{i}", input_ids=prompts[i], sampling=PARAMS,
                              stream=True)
        for out in tiny_engine.stream_sync(req):
            if out.finished:
                got[i] = out.output_ids

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [got[i] for i in range(4)] == want
