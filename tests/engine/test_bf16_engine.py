"""An engine serving a bfloat16 checkpoint in bfloat16 (issue 30): "auto" picks the
checkpoint's dtype where the native bfloat16 kernels run, the calibration verifies them,
the checkpoint's bits reach the device unchanged, and the determinism the float32 engine
has holds: pauses in every mode, abort + resubmit, a batch equal to each request alone,
weight updates (tensor and disk) bit-exact, memory release and resume.

Where the native bfloat16 kernels cannot run (no compiler), "auto" serves float32 and
these tests are skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from engine_helpers import AtTokens, Collector, Trigger, ids_and_logprobs

from multiserve.model.kernels import native as native_kernels
from multiserve.types import SamplingParams

BF16 = np.dtype(ml_dtypes.bfloat16)
PROMPTS = [[5, 17, 42, 99, 7, 8], [3, 3, 8] * 5, [11, 12, 13], [40, 41]]
MAX_NEW = 14

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or native_kernels.unavailable_reason("bfloat16")
    is not None, reason="the native bfloat16 kernels do not run here")


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                              return_logprob=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_new_tokens=MAX_NEW,
                          ignore_eos=True, return_logprob=True)


def _run(engine: Any, indexes: range = range(len(PROMPTS))) -> dict:
    col = Collector(engine)
    col.submit_all([PROMPTS[i] for i in indexes], [_params(i) for i in indexes])
    return ids_and_logprobs(col.wait())


def _alone(engine: Any) -> dict:
    """Each request run alone, keyed as a batch of all of them would be."""
    return {(f"r{i}", 0): next(iter(_run(engine, range(i, i + 1)).values()))
            for i in range(len(PROMPTS))}


def _checkpoint(model_dir: Path) -> tuple[Any, dict]:
    """(config, params) of a checkpoint as stored (bfloat16 stays bfloat16)."""
    from multiserve.model.loading.loader import load_model

    loaded = load_model(str(model_dir), "bfloat16")
    return loaded.config, loaded.params


def _device_bits(engine: Any) -> dict[str, np.ndarray]:
    """The served embedding and layer 1's down projection as get_weights_by_name reads them
    (checked to be bfloat16; bfloat16 -> float32 is exact, so values compare bits), in
    the canonical layout ([V, D], [I, D])."""
    out = {}
    for key, name in (("embed", "model.embed_tokens.weight"),
                      ("w_down", "model.layers.1.mlp.down_proj.weight")):
        read = engine.get_weights_by_name(name, truncate_size=1 << 20)
        assert read.ok and read.details["dtype"] == "bfloat16", read
        values = np.asarray(read.details["values"], np.float32)
        out[key] = values if key == "embed" else values.T
    return out


def _same_bits(served: np.ndarray, want: np.ndarray) -> None:
    assert want.dtype == BF16
    np.testing.assert_array_equal(served, want.astype(np.float32))


@pytest.fixture(scope="module")
def reference(_tiny_engine_bf16: Any) -> dict:
    """Each request alone on the original weights (before any test in this module)."""
    return _alone(_tiny_engine_bf16)


@pytest.fixture
def engine(tiny_engine_bf16: Any, tiny_model_dir_bf16: Path) -> Iterator[Any]:
    yield tiny_engine_bf16
    tiny_engine_bf16.resume_memory_occupation()
    tiny_engine_bf16.continue_generation()
    tiny_engine_bf16.abort_request(abort_all=True)
    if tiny_engine_bf16.get_internal_state()["weight_version"] != "default":
        assert tiny_engine_bf16.update_weights_from_disk(str(tiny_model_dir_bf16),
                                                         "default").ok


def test_auto_serves_the_bf16_checkpoint_natively_with_its_bits(
        engine: Any, tiny_model_dir_bf16: Path) -> None:
    state = engine.get_internal_state()
    assert state["dtype"] == "bfloat16"
    choice = state["dtype_choice"]
    assert choice["requested"] == "auto" and choice["dtype"] == "bfloat16"
    candidates = native_kernels.bf16_path_candidates()
    assert "checkpoint" in choice["reason"] and ", ".join(candidates) in choice["reason"]
    det = state["determinism"]
    assert det["verified"], det["problems"]
    assert det["key"]["bf16_paths"] == list(candidates)
    assert det["plan"]["attention"]["kernel"] == "native"
    # which formulation serves each product at each size is the calibration's timing
    # (native on AVX512_BF16 CPUs, XLA's on some AVX2 ones): the rule is checked, not one
    # outcome. ONE instruction path, the calibration's, in every native product at every
    # size; the plan names a path exactly where a native product uses it.
    paths = {tuple(path) for p in det["plan"]["products"]
             for _, k, _, *path in p["by_rows"] if k == "native"}
    if paths:
        assert paths == {(det["plan"]["bf16_path"],)}
        assert det["plan"]["bf16_path"] in candidates
    else:
        assert det["plan"]["bf16_path"] == ""
    _, params = _checkpoint(tiny_model_dir_bf16)
    bits = _device_bits(engine)
    _same_bits(bits["embed"], params["embed"])
    _same_bits(bits["w_down"], params["layers"]["w_down"][1])
    # every layer matrix (held as bfloat16 k-pair panels where the plan is all-native, and
    # rebuilt from them for the read) reads back with the checkpoint's bits
    from multiserve.model.families.dense import ATTENTION_HF_NAMES, MLP_HF_NAMES

    for key, suffix, transposed in ATTENTION_HF_NAMES + MLP_HF_NAMES:
        if key in params["layers"] and transposed:
            read = engine.get_weights_by_name(f"model.layers.0.{suffix}", 1 << 20)
            assert read.ok and read.details["dtype"] == "bfloat16", read
            _same_bits(np.asarray(read.details["values"], np.float32).T,
                       params["layers"][key][0])


def test_a_batch_equals_each_request_alone(engine: Any, reference: dict) -> None:
    assert _run(engine) == reference


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_keeps_outputs_bitwise(engine: Any, trigger: Trigger, reference: dict,
                                     mode: str) -> None:
    hook = AtTokens(trigger, "r0", 5, lambda: engine.acontrol("pause_generation", mode=mode))
    col = Collector(engine, on_output=hook)
    col.submit_all(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    (res,) = hook.wait()
    assert res.ok
    if mode == "abort":  # partial prefixes, then the same requests again: the same outputs
        for k, (ids, lps) in ids_and_logprobs(col.wait()).items():
            assert (ids, lps) == (reference[k][0][:len(ids)], reference[k][1][:len(ids)])
        assert engine.continue_generation().ok
        assert _run(engine) == reference
        return
    assert engine.continue_generation().ok
    assert ids_and_logprobs(col.wait()) == reference


def test_bf16_tensor_and_disk_updates_are_bit_exact(engine: Any, reference: dict,
                                                   tiny_model_dir_bf16: Path,
                                                   tmp_path: Path) -> None:
    from multiserve.model.loading.loader import save_hf_dir

    cfg, params = _checkpoint(tiny_model_dir_bf16)
    rng = np.random.default_rng(1)

    def perturb(a: np.ndarray) -> np.ndarray:  # what a bfloat16 trainer sends
        return (a.astype(np.float32) * (1 + 0.3 * rng.standard_normal(a.shape))).astype(BF16)

    new = {k: ({kk: perturb(vv) for kk, vv in v.items()} if k == "layers" else perturb(v))
           for k, v in params.items()}
    assert engine.update_weights_from_tensor(new, "v1").ok
    _same_bits(_device_bits(engine)["w_down"], new["layers"]["w_down"][1])
    after = _run(engine)
    assert sum(after[k][0] != reference[k][0] for k in reference) >= len(reference) - 1
    # a bfloat16 checkpoint on disk: its bits, then the original's again
    save_hf_dir(tmp_path / "v2", cfg, new, dtype=BF16)
    assert engine.update_weights_from_disk(str(tmp_path / "v2"), "v2").ok
    _same_bits(_device_bits(engine)["embed"], new["embed"])
    assert _run(engine) == after
    assert engine.update_weights_from_disk(str(tiny_model_dir_bf16), "default").ok
    assert _run(engine) == reference


def test_release_and_resume_restore_the_bf16_weights(engine: Any, reference: dict) -> None:
    bits = _device_bits(engine)
    assert engine.release_memory_occupation().ok
    assert engine.resume_memory_occupation().ok
    again = _device_bits(engine)
    for name, a in bits.items():
        np.testing.assert_array_equal(again[name], a)
    assert _run(engine) == reference


def test_doctor_names_the_plan_path_its_costs_and_the_product_tuning(
        tiny_model_dir_bf16: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`multiserve doctor --dtype bfloat16` on the checkpoint: the calibration's one path
    (a candidate it timed: with several, one cost row per path and one chosen), every
    native product of the plan on it, and the machine's product tuning; the text form
    says the same."""
    import argparse
    import json

    from multiserve.doctor.main import doctor_main

    args = argparse.Namespace(model=str(tiny_model_dir_bf16), dtype="bfloat16", tp=1,
                              reprobe=False, json=True, target=None)
    assert doctor_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    candidates = native_kernels.bf16_path_candidates()
    assert report["bf16_path_candidates"] == list(candidates)
    native = any(f[1] == "native" for p in report["plan"]["products"] for f in p["by_rows"])
    # a path where a native product serves (whether one does is the calibration's timing)
    assert report["bf16_plan_path"] in (candidates if native else ("",))
    costs = [row for row in report["table"] if row["primitive"] == "bf16_path"]
    assert len(costs) == (len(candidates) if len(candidates) > 1 else 0)
    assert [row["path"] for row in costs if row["chosen"]] == (
        [report["bf16_plan_path"]] if costs else [])
    paths = {f[3] if len(f) > 3 else "" for p in report["plan"]["products"]
             for f in p["by_rows"] if f[1] == "native"}
    assert paths <= {report["bf16_plan_path"]}
    assert report["product_tuning"] == {**native_kernels.tuned().key(),
                                        "source": native_kernels.tuned().source}
    args.json = False
    assert doctor_main(args) == 0
    text = capsys.readouterr().out
    assert f"bfloat16 products: {report['bf16_plan_path'] or 'none in this plan'}" in text
    assert "native products: split over the pool from" in text
