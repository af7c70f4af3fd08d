"""Routing replay (`return_routed_experts`) on a Qwen3-MoE engine (tests/moe_checkpoints.py:
3 layers, sparse-dense-sparse, 8 experts, top-2) started with enable_return_routed_experts:
every finished output carries the expert ids of positions [start, prompt + output - 1),
every layer (-1 in the dense layer), and they are the ids transformers' router picks for
the same tokens; the same whatever the batch, a pause (retract: the sequence recomputed;
in place), an abort (the partial output's rows) with the rest resubmitted from where it
stopped (`routed_experts_start_len`), or speculation (verify rows: only the accepted
positions' ids stay). The refusals: a dense model, an engine without the option, a start
past the prompt."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import (
    TINY_ENGINE,
    AtTokens,
    Oracle,
    Trigger,
    assert_idle_and_clean,
    drafting,
    held,
)
from moe_checkpoints import hf_router_topk, make_model, save

from multiserve.config import EngineConfig
from multiserve.engine.streams import assembling
from multiserve.types import GenerateRequest, InvalidRequest, RequestOutput, SamplingParams

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=MAX_NEW,
                        ignore_eos=True)
Key = tuple[str, int]


def _prompts(seed: int = 5, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


class Runs:
    """Submits routing-replay requests (one engine command) and collects final outputs."""

    def __init__(self, engine: Any, hook: Any = None) -> None:
        import threading

        self.engine, self.hook = engine, hook
        self.final: dict[Key, RequestOutput] = {}
        self._cv = threading.Condition()
        self.expected = 0

    def _sink(self, out: RequestOutput) -> None:
        with self._cv:
            if out.finished:
                self.final[(out.rid, out.index)] = out
                self._cv.notify_all()
        if self.hook is not None:
            self.hook(out)

    def submit(self, prompts: list[list[int]], start: int = 0, prefix: str = "r",
               params: list[SamplingParams] | None = None) -> None:
        params = params or [GREEDY if i % 2 == 0 else SEEDED for i in range(len(prompts))]
        reqs = [GenerateRequest(rid=f"{prefix}{i}", input_ids=tuple(p), sampling=sp,
                                stream=True, return_routed_experts=True,
                                routed_experts_start_len=start)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        self.expected += sum(r.sampling.n for r in reqs)
        with held(self.engine):  # all start in the same step
            self.engine.submit_many(reqs, [assembling(self._sink) for _ in reqs])

    def wait(self) -> dict[Key, RequestOutput]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.final) >= self.expected, 120.0)
            return dict(self.final)


def _routing(outs: dict[Key, RequestOutput]) -> dict[Key, tuple]:
    return {k: (o.output_ids, o.routed_experts.start, o.routed_experts.ids())
            for k, o in outs.items()}


def hf_rows(model: Any, tokens: list[int], num_layers: int) -> list[list[list[int]]]:
    """Transformers' router top-k of every token, every layer ([-1, -1] in a dense one)."""
    got = hf_router_topk(model, tokens)
    return [[got[i][t].tolist() if i in got else [-1, -1] for i in range(num_layers)]
            for t in range(len(tokens))]


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return make_model("qwen3_moe", seed=9)


@pytest.fixture(scope="module")
def routed_engine(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from multiserve.engine.engine import Engine

    path = save(hf_model, tmp_path_factory.mktemp("qwen3-moe-routed"))
    eng = Engine(EngineConfig(model_path=str(path), enable_return_routed_experts=True,
                              **TINY_ENGINE))
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(routed_engine: Any) -> dict[Key, tuple]:
    """Each prompt run alone (nothing else in its steps)."""
    out: dict[Key, tuple] = {}
    for i, p in enumerate(_prompts()):
        runs = Runs(routed_engine)
        sp = GREEDY if i % 2 == 0 else SEEDED
        runs.submit([p], prefix=f"alone{i}-", params=[sp])
        ((_, o),) = runs.wait().items()
        out[(f"r{i}", 0)] = (o.output_ids, o.routed_experts.start, o.routed_experts.ids())
    return out


def test_alone_matches_transformers_router(routed_engine: Any, reference: dict,
                                           hf_model: Any) -> None:
    layers = routed_engine.model_config.num_layers
    for i, p in enumerate(_prompts()):
        ids, start, rows = reference[(f"r{i}", 0)]
        assert start == 0 and len(ids) == MAX_NEW
        assert len(rows) == len(p) + MAX_NEW - 1  # the last token has no forward
        assert rows == hf_rows(hf_model, p + list(ids[:-1]), layers), i
    assert len({e for rows in (r for _, _, r in reference.values()) for row in rows
                for layer in row for e in layer}) == 9  # all 8 experts and the dense -1


def test_batch_pauses_and_start_len(routed_engine: Any, reference: dict,
                                    trigger: Trigger) -> None:
    runs = Runs(routed_engine)
    runs.submit(_prompts())
    assert _routing(runs.wait()) == reference
    for mode in ("retract", "in_place"):
        hook = AtTokens(trigger, "r0", 5,
                        lambda m=mode: routed_engine.acontrol("pause_generation", mode=m))
        runs = Runs(routed_engine, hook)
        runs.submit(_prompts())
        (res,) = hook.wait()
        assert res.ok, res
        assert routed_engine.continue_generation().ok
        assert _routing(runs.wait()) == reference, mode
    # only the rows from routed_experts_start_len on
    runs = Runs(routed_engine)
    runs.submit(_prompts(), start=4)
    for k, (ids, start, rows) in _routing(runs.wait()).items():
        assert (ids, start, rows) == (reference[k][0], 4, reference[k][2][4:])
    assert_idle_and_clean(routed_engine)


def test_abort_then_resubmit(routed_engine: Any, reference: dict, trigger: Trigger) -> None:
    """slime's partial rollout: the aborted output carries its rows; the prompt + partial
    output resubmitted with routed_experts_start_len = its rows continues them."""
    prompts = _prompts()
    async def stop() -> Any:  # certain, not raced: paused in place, then aborted
        await routed_engine.acontrol("pause_generation", mode="in_place")
        return await routed_engine.acontrol("abort_request", rid="r0")

    hook = AtTokens(trigger, "r0", 4, stop)
    runs = Runs(routed_engine, hook)
    runs.submit(prompts)
    (res,) = hook.wait()
    assert res.ok, res
    assert routed_engine.continue_generation().ok
    part = runs.wait()[("r0", 0)]
    assert part.finish_reason == "abort"
    k = len(part.output_ids)
    full_ids, _, full_rows = reference[("r0", 0)]
    assert 4 <= k < MAX_NEW and part.output_ids == full_ids[:k]
    n = len(prompts[0]) + k - 1
    assert part.routed_experts.ids() == full_rows[:n]
    rest = Runs(routed_engine)
    rest.submit([prompts[0] + list(part.output_ids)], start=n, prefix="again",
                params=[SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW - k,
                                       ignore_eos=True)])
    out = rest.wait()[("again0", 0)]
    assert part.output_ids + out.output_ids == full_ids
    assert out.routed_experts.start == n
    assert part.routed_experts.ids() + out.routed_experts.ids() == full_rows
    assert_idle_and_clean(routed_engine)


def test_retracted_then_aborted_keeps_its_rows(routed_engine: Any, reference: dict,
                                              trigger: Trigger) -> None:
    """Aborted while waiting after a retraction (its pages freed): the rows it had."""
    async def stop() -> Any:
        await routed_engine.acontrol("pause_generation", mode="retract")
        return await routed_engine.acontrol("abort_request", rid="r1")

    hook = AtTokens(trigger, "r1", 3, stop)
    runs = Runs(routed_engine, hook)
    runs.submit(_prompts())
    (res,) = hook.wait()
    assert res.ok, res
    assert routed_engine.continue_generation().ok
    outs = runs.wait()
    part = outs[("r1", 0)]
    k = len(part.output_ids)
    assert part.finish_reason == "abort" and 3 <= k < MAX_NEW
    assert part.routed_experts.ids() == reference[("r1", 0)][2][:len(_prompts()[1]) + k - 1]
    others = {key: v for key, v in _routing(outs).items() if key != ("r1", 0)}
    assert others == {key: v for key, v in reference.items() if key != ("r1", 0)}
    assert_idle_and_clean(routed_engine)


@pytest.mark.parametrize("wrong", [False, True])
def test_speculation_keeps_accepted_positions_only(routed_engine: Any, reference: dict,
                                                   wrong: bool) -> None:
    oracle = Oracle({k: ids for k, (ids, _, _) in reference.items()}, wrong=wrong, vocab=500)
    before = routed_engine.get_internal_state()["spec_verify_ct"]
    with drafting(routed_engine, oracle):
        runs = Runs(routed_engine)
        runs.submit(_prompts())
        assert _routing(runs.wait()) == reference
    assert routed_engine.get_internal_state()["spec_verify_ct"] > before
    assert oracle.proposed > 0
    assert_idle_and_clean(routed_engine)


def test_refusals(routed_engine: Any) -> None:
    from multiserve.engine.engine import Engine

    def ask(start: int = 0) -> GenerateRequest:
        return GenerateRequest(rid="x", input_ids=(5, 6, 7), sampling=GREEDY,
                               return_routed_experts=True, routed_experts_start_len=start)

    with pytest.raises(InvalidRequest, match=r"must be in \[0, 3\]") as e:
        routed_engine.submit(ask(4), lambda d: None)
    assert e.value.param == "routed_experts_start_len"
    # the same check, on an engine of a dense model and on one without the option
    dense = SimpleNamespace(model_config=SimpleNamespace(moe_layers=(), architecture="llama"),
                            config=EngineConfig(enable_return_routed_experts=True),
                            model_name="tiny-dense")
    with pytest.raises(InvalidRequest, match="tiny-dense .llama. is dense"):
        Engine._check_routed_experts(dense, ask())  # type: ignore[arg-type]
    off = SimpleNamespace(model_config=routed_engine.model_config, config=EngineConfig(),
                          model_name="moe")
    with pytest.raises(InvalidRequest, match="not started with --enable-return-routed-experts"):
        Engine._check_routed_experts(off, ask())  # type: ignore[arg-type]
    assert_idle_and_clean(routed_engine)


def test_capture_only_with_the_option(routed_engine: Any) -> None:
    """An engine without the option compiles the programs it always did: no expert-id
    output (its StepFunctions trace forward_hidden); with it, one [T, MoE layers, k]."""
    runner = routed_engine._core.runner  # noqa: SLF001 - the programs' owner
    assert runner.routed_experts and runner.step_programs.functions.routed_experts
    assert not EngineConfig().enable_return_routed_experts
    table = routed_engine._core.routed_experts  # noqa: SLF001
    assert table is not None and (table.moe_layers, table.top_k) == ((0, 2), 2)
