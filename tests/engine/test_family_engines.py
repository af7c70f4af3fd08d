"""Engines of the families added after Llama / Qwen (tests/family_checkpoints.py: prompts
longer than the window, 8-token pages, so pages leave the window while requests decode) in
float32, and in bfloat16 for one dense and one MoE family (Gemma 3, GPT-OSS: between them
every bfloat16 path of the others, windowed attention on a bf16 pool, sinks, sandwich
norms, biased experts; the suite's time budget buys no more), on the plan their engine
calibrated: a batch equals each request
alone, a pause in each mode and an abort + resubmit of the partial output give the
uninterrupted output, drafts always right or always wrong change nothing (ids and logprobs
bit for bit, greedy and seeded); a prompt already served reuses its cached pages, those
that had left the window included; greedy ids equal transformers' (float32), and a MoE
family's routed experts (`return_routed_experts`) are the experts transformers' router
picks, past the window too."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import (
    TINY_ENGINE,
    AtTokens,
    Collector,
    Oracle,
    Trigger,
    assert_idle_and_clean,
    drafting,
    greedy_and_seeded,
    ids_and_logprobs,
    run_alternating,
)
from family_checkpoints import ARCHS, WINDOW, make_model
from moe_checkpoints import hf_router_topk, save

from multiserve.config import EngineConfig
from multiserve.model.kernels import native as native_kernels
from multiserve.model.loading.hf import load_hf_config
from multiserve.types import SamplingParams

MAX_NEW = 16
PAIR = greedy_and_seeded(MAX_NEW)
GREEDY = PAIR[0]
_MODELS: dict[str, tuple[Any, Path]] = {}


def _prompts(seed: int = 3, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(WINDOW + 5, 60))]
            for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    return [PAIR[i % 2] for i in range(n)]


def _run(engine: Any, prompts: list[list[int]], hook: Any = None) -> dict:
    return run_alternating(engine, prompts, PAIR, hook)


BF16 = ("gemma3", "gpt_oss")  # (module docstring)


@pytest.fixture(scope="module", params=[(a, d) for a in sorted(ARCHS)
                                        for d in ("float32", "bfloat16")
                                        if d == "float32" or a in BF16],
                ids=lambda p: f"{p[0]}-{p[1]}")
def family_engine(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """(arch, an engine of its checkpoint in the dtype); the checkpoint's transformers
    model in `_MODELS`."""
    from multiserve.engine.engine import Engine

    arch, dtype = request.param
    if dtype == "bfloat16" and native_kernels.unavailable_reason("bfloat16") is not None:
        pytest.skip("the native bfloat16 kernels do not run here")
    if arch not in _MODELS:
        model = make_model(arch, seed=11)
        _MODELS[arch] = (model, save(model, tmp_path_factory.mktemp(arch)))
    routed = dtype == "float32" and load_hf_config(_MODELS[arch][1]).num_experts > 0
    # one token bucket: these steps (32-token prefill chunks beside <= 5 decode rows and
    # their drafts) fit 64; TINY_ENGINE's 128 would be one more forward compile an engine
    eng = Engine(EngineConfig(model_path=str(_MODELS[arch][1]), dtype=dtype,
                              enable_return_routed_experts=routed,
                              **{**TINY_ENGINE, "precompile_token_paddings": (64,)}))
    try:
        yield arch, eng
    finally:
        eng.shutdown()


def test_batch_alone_pauses_abort_resubmit_and_drafts(family_engine: tuple[str, Any],
                                                      trigger: Trigger) -> None:
    arch, engine = family_engine
    state = engine.get_internal_state()
    assert state["determinism"]["verified"], state["determinism"]["problems"]
    prompts = _prompts()
    reference = _run(engine, prompts)
    assert len({ids for ids, _ in reference.values()}) == len(prompts)  # varied outputs
    for i, p in enumerate(prompts):  # alone
        col = Collector(engine)
        col.submit(f"r{i}", p, _params(len(prompts))[i])
        assert ids_and_logprobs(col.wait())[(f"r{i}", 0)] == reference[(f"r{i}", 0)], i
    for mode in ("retract", "in_place"):
        hook = AtTokens(trigger, "r0", 5,
                        lambda m=mode: engine.acontrol("pause_generation", mode=m))
        got = _run_paused(engine, prompts, hook)
        assert got == reference, mode
    # abort at r0's 7th token, then every partial output resubmitted with what is left
    hook = AtTokens(trigger, "r0", 7, lambda: engine.acontrol("abort_request",
                                                              abort_all=True))
    col = Collector(engine, on_output=hook)
    col.submit_all(prompts, _params(len(prompts)))
    hook.wait()
    partial = col.wait()
    resumed = Collector(engine)
    for i, p in enumerate(prompts):
        part = partial[(f"r{i}", 0)]
        if len(part.output_ids) < MAX_NEW:
            resumed.submit(f"r{i}", p + list(part.output_ids), _params(len(prompts))[i]
                           .with_updates(max_new_tokens=MAX_NEW - len(part.output_ids)))
    rest = resumed.wait()
    assert rest, "nothing was resumed"
    for i in range(len(prompts)):
        key = (f"r{i}", 0)
        ids, lps = ids_and_logprobs({key: partial[key]})[key]
        if key in rest:
            more = ids_and_logprobs({key: rest[key]})[key]
            ids, lps = ids + more[0], lps + more[1]
        assert (ids, lps) == reference[key], (arch, key)
    for wrong in (False, True):
        oracle = Oracle({k: ids for k, (ids, _) in reference.items()}, wrong=wrong, vocab=500)
        with drafting(engine, oracle):
            assert _run(engine, prompts) == reference, wrong
        assert oracle.proposed > 0
    assert engine.get_internal_state()["spec_verify_ct"] > 0
    assert_idle_and_clean(engine)


def _run_paused(engine: Any, prompts: list[list[int]], hook: AtTokens) -> dict:
    col = Collector(engine, on_output=hook)
    col.submit_all(prompts, _params(len(prompts)))
    (res,) = hook.wait()
    assert res.ok, res
    assert engine.continue_generation().ok
    return ids_and_logprobs(col.wait())


def test_a_served_prompt_is_reused_past_the_window(family_engine: tuple[str, Any],
                                                   trigger: Trigger) -> None:
    """A long request decodes far past its window (where every layer slides, its early
    pages are dropped into the prefix cache as it goes; where some layer is global, none
    is); the same prompt plus part of that output, sent again, hits the cache over the
    whole prefix and gives the bits of a cold run."""
    from multiserve.engine.commands import Call

    arch, engine = family_engine
    prompt = _prompts(seed=8, n=1)[0]
    hook = AtTokens(trigger, "long", 40, lambda: engine.acall(Call(
        lambda core: [r.window_dropped for r in core.scheduler.running])))
    first = Collector(engine, on_output=hook)
    first.submit("long", prompt, GREEDY.with_updates(max_new_tokens=48))
    ((dropped,),) = hook.wait()
    if load_hf_config(_MODELS[arch][1]).kv_window:  # every layer slides
        assert dropped >= (len(prompt) + 40 - WINDOW) // 8 - 1, dropped
    else:
        assert dropped == 0, dropped
    out = first.wait()[("long", 0)]
    follow = prompt + list(out.output_ids[:40])
    hit = Collector(engine)
    hit.submit("hit", follow, GREEDY)
    warm = hit.wait()[("hit", 0)]
    assert warm.cached_tokens >= (len(follow) - 8) // 8 * 8 > len(prompt)
    engine.flush_cache()
    cold = Collector(engine)
    cold.submit("cold", follow, GREEDY)
    again = cold.wait()[("cold", 0)]
    assert again.cached_tokens == 0
    assert ids_and_logprobs({0: warm})[0] == ids_and_logprobs({0: again})[0]
    assert_idle_and_clean(engine)


def test_greedy_ids_match_transformers(family_engine: tuple[str, Any]) -> None:
    import torch

    arch, engine = family_engine
    if engine.get_internal_state()["dtype"] != "float32":
        pytest.skip("transformers' float32 model is the reference of the float32 engine")
    model = _MODELS[arch][0]
    prompt = _prompts(seed=9, n=1)[0]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    col = Collector(engine)
    col.submit("g", prompt, GREEDY.with_updates(max_new_tokens=24))
    got = list(col.wait()[("g", 0)].output_ids)
    assert got == want, np.nonzero(np.asarray(got) != np.asarray(want))


def test_routed_experts_are_transformers_router_choices(family_engine: tuple[str, Any]
                                                        ) -> None:
    """A routing-replay request through the window (a Mixtral's request that replays
    keeps every page): its expert ids are transformers' router choices."""
    from concurrent.futures import Future

    from multiserve.engine.streams import assembling
    from multiserve.types import GenerateRequest

    arch, engine = family_engine
    if not engine.model_config.num_experts or \
            engine.get_internal_state()["dtype"] != "float32":
        pytest.skip("routing replay: the float32 MoE engines")
    prompt = _prompts(seed=10, n=1)[0]
    done: Future = Future()
    engine.submit(GenerateRequest(rid="routed", input_ids=tuple(prompt), sampling=GREEDY,
                                  return_routed_experts=True),
                  assembling(lambda out: done.set_result(out) if out.finished else None))
    out = done.result(timeout=120)
    tokens = prompt + list(out.output_ids[:-1])  # the last token has no forward
    got = hf_router_topk(_MODELS[arch][0], tokens,
                         {"mixtral": "gate", "gpt_oss": "router"}[arch])
    want = [[got[i][t].tolist() for i in range(len(got))] for t in range(len(tokens))]
    assert out.routed_experts.ids() == want


def test_constrained_outputs_alone_equal_batched(family_engine: tuple[str, Any]) -> None:
    """A regex grammar (engine/grammar): greedy and seeded constrained samples are in the
    language and the same bits alone as beside each other and a free request."""
    import re

    from transformers import PreTrainedTokenizerFast

    from multiserve.grammar.compiler import GrammarCompiler

    arch, engine = family_engine
    words = r"[a-z]{2,6}( [a-z]{2,6}){1,4}\."
    tok = PreTrainedTokenizerFast.from_pretrained(str(_MODELS[arch][1]))
    grammar = GrammarCompiler.for_hf_tokenizer(tok, 512, [2]).compile("regex", words)
    params = [p.with_updates(grammar=grammar, ignore_eos=False, max_new_tokens=48)
              for p in PAIR] + [PAIR[1]]
    prompts = _prompts(seed=12, n=3)

    def run(idx: list[int]) -> dict:
        col = Collector(engine)
        col.submit_all([prompts[i] for i in idx], [params[i] for i in idx])
        return {i: bits for i, (_, bits) in zip(
            idx, sorted(ids_and_logprobs(col.wait()).items()), strict=True)}

    together = run([0, 1, 2])
    for i in (0, 1):
        assert run([i]) == {i: together[i]}
        text = tok.decode(list(together[i][0]), skip_special_tokens=True)
        assert re.fullmatch(words, text), text
