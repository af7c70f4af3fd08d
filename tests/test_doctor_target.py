"""`multiserve doctor --target cuda|tpu` (doctor/target.py) on this CPU-only machine: the
whole model forward and the engine's FORWARD, FUSED and DECODE_STEPS (K decode steps in one
loop) step programs of the default model and of the 1B-shaped random bfloat16 model lower for
each accelerator with `jax.export`, with that platform's Pallas attention kernel in the
program, and the report names the kernels the target starts from. The 1B shape is lowered
with 4 of its 16 layers (LAYERS_1B): an unrolled decoder lowers each layer alike, and the
default model's 30 are lowered whole (the 1B's other 12 layers: ~7 of the file's ~25 CPU-s)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest

from multiserve.bench.random_model import SIZES
from multiserve.cli import main
from multiserve.doctor.target import print_target_report

LAYERS_1B = 4  # (module docstring)


@functools.cache
def _doctor_json(target: str) -> tuple[int, dict[str, Any]]:
    """(exit code, report) of `multiserve doctor --target <target> --json`: run once per
    target, its report read by both tests (the text is rendered from the same report)."""
    out = io.StringIO()
    small_1b = replace(SIZES["1b"], num_layers=LAYERS_1B)
    with mock.patch.dict(SIZES, {"1b": small_1b}), contextlib.redirect_stdout(out):
        rc = main(["doctor", "--target", target, "--json"])
    return rc, json.loads(out.getvalue())


@pytest.mark.parametrize("target,kernel", [("cuda", "pallas_gpu"), ("tpu", "pallas_tpu")])
def test_doctor_target_lowers_both_models(target: str, kernel: str) -> None:
    rc, report = _doctor_json(target)
    failures = [e["error"] for m in report["models"] for e in m["exports"] if e["error"]]
    assert rc == 0 and report["lowered"], failures
    assert report["target"] == target and report["host_platform"] == "cpu"
    default, big = report["models"]
    assert (default["shape"]["layers"], default["shape"]["hidden"]) == (30, 576)  # SmolLM2-135M
    assert SIZES["1b"].num_layers == 16  # the shape's own, outside the patch
    assert (big["shape"]["layers"], big["shape"]["hidden"], big["dtype"]) == (
        LAYERS_1B, 2048, "bfloat16")
    for model in report["models"]:
        assert model["attention"]["kernel"] == kernel
        assert {p["name"] for p in model["products"]} >= {"wq", "w_down", "head"}
        assert model["problems"] and "not calibrated" in model["problems"][0]
        # the model forward of a decode step and of the largest mixed step, then the
        # engine's FORWARD, FUSED and DECODE_STEPS (4 decode steps of the fused step) programs
        # of a decode step, each holding the Pallas kernel; an accelerator's decoder is
        # unrolled at every size (llama.scans)
        assert [(e["tokens"], e["scanned"]) for e in model["exports"]] == [
            (16, False), (512, False), (16, False), (16, False), (16, False)]
        assert "FUSED" in model["exports"][3]["what"]
        steps = model["exports"][4]["what"]
        assert "DECODE_STEPS" in steps and "4 decode steps" in steps
        assert all(e["pallas_calls"] >= 1 for e in model["exports"])


def test_doctor_target_text(capsys: pytest.CaptureFixture[str]) -> None:
    print_target_report(_doctor_json("cuda")[1])
    out = capsys.readouterr().out
    assert "attention kernel: pallas_gpu" in out and "LOWERED: True" in out
    assert out.count("lowered for cuda") == 10
    assert out.count("engine DECODE_STEPS program of 16 tokens, 16 rows, 4 decode steps") == 2
