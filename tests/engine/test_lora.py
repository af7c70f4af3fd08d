"""LoRA adapters in the engine (issue 47): each token's low-rank product gathered from its
own slot (model/layers/lora.py), on the tiny random Llama.

- base rows of an engine with LoRA are bit for bit those of the engine without it (the
  shared `tiny_engine`), ids and logprobs;
- a batch mixing the base model and two adapters gives every row exactly the ids and
  logprobs it gets alone (there at T=8, in the batch at T=64), greedy and seeded, float32
  and bfloat16; and the same bits when paused mid-generation (retract, in place) and
  continued, or aborted and submitted again;
- an adapter changes the output (the delta reaches the logits), a PEFT directory and the
  same tensors in memory give the same bits, and loading never compiles a step program;
- a LoRA request reuses cached prefix pages of its own adapter version only, with the
  bits it computes without them;
- refusals change nothing: rank above max_lora_rank, an unsupported module, a wrong shape,
  a full slot table, an unknown adapter, unloading an adapter live requests use.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import TINY_ENGINE, AtTokens, Collector, Trigger, ids_and_logprobs
from lora_checkpoints import BLOCKS, assert_matches_peft, loaded, peft_tensors, refused

from multiserve.types import InvalidRequest, SamplingParams

PROMPTS = [[5, 9, 13, 17, 21], [7, 3, 30, 44, 12, 6, 9, 19, 40, 8, 11], [14, 15, 16],
           [(7 * i) % 90 + 3 for i in range(40)]]
# the LoRA engines' token buckets: a row alone decodes at T=8, in the mixed batch at T=64
# 1: a request alone decodes in one-token steps, whose LoRA delta runs inside the
# product's call (row_gemm_lora.cc), where the mixed batches' steps of 8 run the product
# and the delta as two calls: the tests below compare the two forms' bits
LORA_ENGINE = {**TINY_ENGINE, "precompile_token_paddings": (1, 8, 64)}


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir: Path) -> Iterator[Any]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **LORA_ENGINE,
                              max_loras_per_batch=3, max_lora_rank=8))
    cfg = eng.model_config
    loaded(eng.load_lora_adapter("a1", tensors=peft_tensors(cfg, 4, 1), r=4, lora_alpha=8))
    loaded(eng.load_lora_adapter("a2", tensors=peft_tensors(cfg, 8, 2, ("q_proj", "v_proj",
                                                                         "down_proj")),
                                 r=8, lora_alpha=16, use_rslora=True,
                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    try:
        yield eng
    finally:
        eng.shutdown()


def _params(seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_new_tokens=12,
                              ignore_eos=True, return_logprob=True)
    return SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                          return_logprob=True)


def _bits(out: Any) -> tuple[Any, ...]:
    return tuple(out.output_ids), tuple(t.logprob for t in out.logprobs)


def _run(engine: Any, rows: list[tuple[int, str | None]], seeded: bool) -> list[Any]:
    outs = engine.generate(input_ids=[PROMPTS[p] for p, _ in rows],
                           sampling_params=_params(seeded),
                           lora_name=[name for _, name in rows])
    return [_bits(o) for o in outs]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_mixed_batch_rows_equal_each_alone_and_base_rows_equal_no_lora(
        lora_engine: Any, tiny_engine: Any, seeded: bool) -> None:
    rows = [(0, None), (0, "a1"), (1, "a2"), (1, None), (2, "a1"), (2, "a2"), (0, "a2"),
            (3, "a1"), (3, None), (3, "a2")]
    mixed = _run(lora_engine, rows, seeded)
    alone = [_run(lora_engine, [row], seeded)[0] for row in rows]
    assert mixed == alone
    # base rows: the engine without LoRA, bit for bit
    without = _run(tiny_engine, [(p, None) for p, _ in rows], seeded)
    for (p, name), got, want in zip(rows, mixed, without, strict=True):
        if name is None:
            assert got == want, p
        else:  # the adapter reaches the output
            assert got != want, (p, name)


MIXED = [(0, None), (1, "a1"), (2, "a2"), (3, "a1"), (0, "a2"), (3, None)]


def _submit_mixed(col: Collector) -> None:
    col.submit_all([PROMPTS[p] for p, _ in MIXED],
                   [_params(i % 2 == 1) for i in range(len(MIXED))],
                   lora_names=[name for _, name in MIXED])


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_mixed_adapter_rows_keep_their_bits_across_a_pause_or_an_abort(
        lora_engine: Any, trigger: Trigger, mode: str) -> None:
    """Base and adapter rows, greedy and seeded (even / odd index), paused after r1 (an
    adapter row) has 5 tokens: continued, each row's ids and logprobs are those of the
    uninterrupted batch; aborted, each row's partial output is a prefix of them and the
    batch submitted again gives them whole."""
    col = Collector(lora_engine)
    _submit_mixed(col)
    want = ids_and_logprobs(col.wait())
    hook = AtTokens(trigger, "r1", 5,
                    lambda: lora_engine.acontrol("pause_generation", mode=mode))
    col = Collector(lora_engine, on_output=hook)
    _submit_mixed(col)
    (res,) = hook.wait()
    assert res.ok
    if mode == "abort":
        partial = ids_and_logprobs(col.wait())
        assert any(len(ids) < 12 for ids, _ in partial.values())
        for key, (ids, lps) in partial.items():
            assert (ids, lps) == (want[key][0][:len(ids)], want[key][1][:len(ids)]), key
        assert lora_engine.continue_generation().ok
        col = Collector(lora_engine)
        _submit_mixed(col)
    else:
        assert lora_engine.continue_generation().ok
    assert ids_and_logprobs(col.wait()) == want


def test_a_peft_directory_gives_the_bits_of_its_tensors_in_memory(
        lora_engine: Any, tmp_path: Path) -> None:
    from multiserve.model.loading import safetensors_io

    cfg = lora_engine.model_config
    tensors = peft_tensors(cfg, 4, 1)  # adapter a1's
    safetensors_io.save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(BLOCKS),
         "bias": "none", "use_rslora": False}))
    res = loaded(lora_engine.load_lora_adapter("a1-disk", str(tmp_path)))
    try:
        assert res["rank"] == 4
        assert {a["name"]: a["slot"] for a in lora_engine.list_lora_adapters()} == {
            "a1": 1, "a2": 2, "a1-disk": 3}
        for p in range(len(PROMPTS)):
            assert _run(lora_engine, [(p, "a1-disk")], False) == \
                _run(lora_engine, [(p, "a1")], False)
        # loading wrote into the buffers: no step program compiled on the step path
        assert lora_engine.get_internal_state()["cache_miss_count"] == 0
    finally:
        loaded(lora_engine.unload_lora_adapter("a1-disk"))


def test_refusals_change_nothing(lora_engine: Any) -> None:
    cfg = lora_engine.model_config
    before = lora_engine.list_lora_adapters()
    cases = {
        "max_lora_rank": dict(tensors=peft_tensors(cfg, 16, 3), r=16),
        "unsupported target modules": dict(tensors=peft_tensors(cfg, 4, 3), r=4,
                                           target_modules=["q_proj", "lm_head"]),
        "expected [4, 64]": dict(tensors={
            **peft_tensors(cfg, 4, 3),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                np.zeros((4, 63), np.float32)}, r=4),
        "no lora_B": dict(tensors={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                np.zeros((4, 64), np.float32)}, r=4),
    }
    for why, kw in cases.items():
        refused(lora_engine.load_lora_adapter("bad", **kw), "invalid", why)
    refused(lora_engine.load_lora_adapter("a1", tensors=peft_tensors(cfg, 4, 1), r=4),
            "exists", "already loaded")
    loaded(lora_engine.load_lora_adapter("a3", tensors=peft_tensors(cfg, 2, 5), r=2))
    try:
        refused(lora_engine.load_lora_adapter("a4", tensors=peft_tensors(cfg, 2, 6), r=2),
                "full", "every LoRA slot is taken")
    finally:
        loaded(lora_engine.unload_lora_adapter("a3"))
    with pytest.raises(InvalidRequest, match="'nope' is not loaded") as bad:
        lora_engine.generate(input_ids=PROMPTS[0], sampling_params=_params(False),
                             lora_name="nope")
    assert bad.value.code == "lora_not_found"
    refused(lora_engine.unload_lora_adapter("nope"), "unknown", "not loaded")
    assert lora_engine.list_lora_adapters() == before


def test_unloading_an_adapter_in_use_is_refused(lora_engine: Any) -> None:
    from multiserve.types import GenerateRequest

    lora_engine.pause_generation("in_place")
    try:
        reqs = [GenerateRequest(rid=f"held-{i}", input_ids=tuple(PROMPTS[0]),
                                sampling=_params(False), lora_name="a2") for i in range(2)]
        lora_engine.submit_many(reqs, [lambda d: None] * 2)
        refused(lora_engine.unload_lora_adapter("a2"), "in_use", "in use by 2 live request")
        lora_engine.abort_request(abort_all=True)
    finally:
        lora_engine.continue_generation()
    assert "a2" in [a["name"] for a in lora_engine.list_lora_adapters()]


def test_greedy_ids_and_logprobs_match_transformers_with_peft(
        lora_engine: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A PEFT adapter saved by peft itself (random A and B, rsLoRA, four modules), applied
    unmerged by transformers + peft in float32: the engine's greedy ids are the same and
    each token's logprob is within 1e-4 of peft's (float32 sums in other orders)."""
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), torch_dtype=torch.float32).eval()
    config = peft.LoraConfig(r=6, lora_alpha=12, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(str(tmp_path))
    loaded(lora_engine.load_lora_adapter("hf", str(tmp_path)))
    try:
        assert_matches_peft(lora_engine, model, PROMPTS, "hf", _params(False))
    finally:
        loaded(lora_engine.unload_lora_adapter("hf"))


def test_prefix_reuse_is_per_adapter_version(lora_engine: Any) -> None:
    """A LoRA request reuses the full pages its adapter's same version computed for its
    prompt, with the bits it computes without them; another adapter, the base model and a
    reload of the same adapter never match them."""
    prompt = [(5 * i) % 80 + 2 for i in range(36)]  # 4 full pages of 8, in no other test

    def run(name: str | None) -> tuple[tuple[Any, ...], int]:
        out = lora_engine.generate(input_ids=prompt, sampling_params=_params(False),
                                   lora_name=name)
        return _bits(out), out.cached_tokens

    first, hit = run("a1")
    assert hit == 0
    assert run("a1") == (first, 32)
    assert run("a2")[1] == 0 and run(None)[1] == 0
    cfg = lora_engine.model_config  # a1 reloaded with its tensors: a new version, its slot
    assert loaded(lora_engine.load_lora_adapter("a1", tensors=peft_tensors(cfg, 4, 1), r=4,
                                                lora_alpha=8, load_inplace=True))["slot"] == 1
    assert run("a1") == (first, 0)


def test_adapters_survive_memory_release(lora_engine: Any) -> None:
    rows = [(1, "a1"), (2, "a2"), (0, None)]
    before = _run(lora_engine, rows, True)
    assert lora_engine.release_memory_occupation().ok
    assert lora_engine.resume_memory_occupation().ok
    assert _run(lora_engine, rows, True) == before


def test_bf16_mixed_rows_equal_each_alone_and_base_rows_equal_no_lora(
        tiny_model_dir_bf16: Path, tiny_engine_bf16: Any) -> None:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir_bf16), **LORA_ENGINE,
                              max_loras_per_batch=2, max_lora_rank=8))
    try:
        assert eng.get_internal_state()["dtype_choice"] == \
            tiny_engine_bf16.get_internal_state()["dtype_choice"]
        cfg = eng.model_config
        loaded(eng.load_lora_adapter("a1", tensors=peft_tensors(cfg, 4, 1), r=4,
                                     lora_alpha=8))
        loaded(eng.load_lora_adapter("a2", tensors=peft_tensors(cfg, 8, 2), r=8,
                                     lora_alpha=16))
        rows = [(0, None), (0, "a1"), (1, "a2"), (2, None), (2, "a1")]
        for seeded in (False, True):
            mixed = _run(eng, rows, seeded)
            assert mixed == [_run(eng, [row], seeded)[0] for row in rows]
            without = _run(tiny_engine_bf16, [(p, None) for p, _ in rows], seeded)
            assert [m for m, (_, n) in zip(mixed, rows, strict=True) if n is None] == \
                [w for w, (_, n) in zip(without, rows, strict=True) if n is None]
    finally:
        eng.shutdown()


def test_a_cpu_engine_computes_the_delta_with_the_native_kernel(lora_engine: Any,
                                                                 tiny_engine: Any) -> None:
    """The tests above then cover the kernel's form (model/kernels/src/lora_delta.cc) where
    the native kernels build, the XLA form elsewhere; an engine without LoRA has none. The
    native form's copy of B panel by panel (`<m>_bp`, read by the one-token kernel) holds
    B's values after the loads, reloads and unloads above."""
    from multiserve.engine.commands import Call
    from multiserve.model.kernels import native
    from multiserve.model.lora_layout import LORA_MODULES, b_panels

    want = "native" if native.unavailable_reason() is None else "xla"
    assert lora_engine.get_internal_state()["lora_kernel"] == want
    assert tiny_engine.get_internal_state()["lora_kernel"] is None
    lora = lora_engine.call(Call(lambda core: core.runner.lora)).result()
    assert ("wq_bp" in lora) == (want == "native")
    for m in LORA_MODULES if want == "native" else ():
        b = np.asarray(lora[f"{m}_b"])
        assert np.any(b[:, 1]), m  # slot 1 holds an adapter
        np.testing.assert_array_equal(np.asarray(lora[f"{m}_bp"]), b_panels(b))
