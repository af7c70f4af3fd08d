"""`multiserve doctor --target tpu --compile` (doctor/compile.py): the engine's step
programs compiled by the real TPU compiler (libtpu, installed by the test extra) for
compile-only v5e and v6e chips from this CPU, and what the compiled programs say they
hold and move. The model is four layers of the 1B shape (bench/random_model.py '1b':
hidden 2048, MLP 8192, 32 / 8 heads of 64) with a small vocabulary, and few buckets keep
it to seconds a program; the report's figures are the compiler's own, so these tests
fail on any compile error, on a program that stops donating its pool, holds a weight
twice, sums a float across chips, or moves more than twice its floor.

The margin: the goal is 1.3x the floor for the 1B shape (16 layers), which `doctor
--compile` measures at 1.03-1.09x for decode at 1, 16 and 64 rows (docs/performance.md
§33). At four layers XLA:TPU still routes some layers' weights through VMEM copies
(`slice-start`, `ConcatBitcast`, `copy-start` in the report's ops), which it counts as
bytes moved: 1.2-1.9x here, so 2.0x is the bound of these small programs; a pool copied
or padded once a step (the old layout: 10-23x) fails it by far."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest

from multiserve.config import EngineConfig, ModelConfig
from multiserve.doctor.compile import compile_model, print_compile_report

SMALL = ModelConfig(architecture="llama", vocab_size=4096, hidden_size=2048,
                    intermediate_size=8192, num_layers=4, num_heads=32, num_kv_heads=8,
                    head_dim=64, tie_word_embeddings=True)
EC = EngineConfig(precompile_token_paddings=(1, 16, 64), precompile_bs_paddings=(1, 16),
                  max_running_requests=16, chunked_prefill_size=64)
# 16 rows at the 1024-token context of the floors, 8x over: a pool small enough for
# VMEM would be copied there whole, which no engine's pool is
KV_PAGES = 8193
RATIO = 2.0  # the floors' bound for these programs (module docstring)
KINDS = {"TPU v5 lite": "v5e:2x2", "TPU v6 lite": "v6e:2x2"}


@functools.cache
def _report(topology: str, tp: int, which: tuple[tuple[str, int], ...],
            layers: int = SMALL.num_layers) -> dict[str, Any]:
    return compile_model("small", replace(SMALL, num_layers=layers), "bfloat16", topology,
                         tp, ec=EC, kv_pages=KV_PAGES, which=list(which))


# on v5e the fused decode step (forward, head and sampler: every kind of program but the
# decode-steps loop of it, which `doctor --compile` compiles), on v6e a decode forward
# (and v5e's forwards in the tensor-parallel test below): seconds a program, within the
# suite's budget; each kind compiled once (the 1-row forward, the same program at
# another bucket, is left to `doctor --compile`)
PROGRAMS = {"v5e:2x2": (("fused", 16),), "v6e:2x2": (("forward", 16),)}


@pytest.mark.parametrize("topology", sorted(PROGRAMS))
def test_step_programs_compile_for_the_tpu(topology: str) -> None:
    report = _report(topology, 1, PROGRAMS[topology])
    errors = [p["error"] for p in report["programs"] if p["error"]]
    assert report["compiled"], errors
    assert KINDS[report["device_kind"]] == topology
    # the TPU plan holds each weight once: the compute params are the checkpoint's bytes
    assert report["params"]["held_bytes"] <= 1.05 * report["params"]["checkpoint_bytes"]
    pool = report["kv"]["bytes"]
    assert pool == 2 * SMALL.num_layers * SMALL.num_kv_heads * SMALL.head_dim * 2 \
        * KV_PAGES * EC.page_size
    for p in report["programs"]:
        h = p["hbm"]
        # the pool is donated: its outputs reuse its buffers, so HBM never holds two pools
        assert h["aliased"] >= pool and h["arguments"] >= pool, (p["kind"], p["size"], h)
        assert h["fits"] is True
        assert p["bytes_accessed"] > 0 and p["flops"] > 0 and p["floor"] > 0
        assert p["ratio"] == pytest.approx(p["bytes_accessed"] / p["floor"], rel=1e-3)
        assert p["ratio"] <= RATIO, (p["kind"], p["size"], p["ratio"], p["top_ops"][:4])
        assert p["top_ops"] and p["top_ops"][0]["bytes"] >= p["top_ops"][-1]["bytes"]
        # an unrolled decoder: one Mosaic attention kernel per layer, every kernel
        # carrying its cost estimate (the compiler's count covers the kernels: it is
        # above the weights)
        assert p["pallas_calls"] == SMALL.num_layers and p["scanned"] is False, \
            (p["kind"], p["pallas_calls"], p["scanned"])
        assert p["bytes_accessed"] >= p["floor"]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_programs_compile_without_float_sums(tp: int) -> None:
    """Over 2 and 4 v5e chips (attention split: 4 KV heads divide): the Pallas kernel runs
    in a shard_map, and the collectives are gathers and the embedding's integer sum."""
    report = _report("v5e:2x2", tp, (("forward", 16),), layers=2)
    assert report["compiled"], [p["error"] for p in report["programs"]]
    assert report["kv"]["bytes_per_chip"] * tp == report["kv"]["bytes"]
    assert report["params"]["held_bytes_per_chip"] < report["params"]["held_bytes"]
    for p in report["programs"]:
        ops = {(c["op"], c["dtype"]) for c in p["collectives"]}
        assert ("all-gather", "bf16") in ops, ops
        assert not {o for o in ops if o[0] in ("all-reduce", "reduce-scatter")
                    and o[1] in ("f32", "bf16", "f16")}, ops  # no float sum across chips


def test_a_moe_model_compiles_over_two_chips() -> None:
    """Mixtral over 2 v5e chips: its experts split over the chips take "gather" (the
    grouped matmul is a Mosaic call the compiler does not partition: gmm_usable), the
    target plan is the TP degree's, and each weight is held once, half on each chip."""
    from multiserve.bench.random_model import SIZES

    cfg = replace(SIZES["small-mixtral"], vocab_size=4096)
    ec = replace(EC, precompile_token_paddings=(16,), chunked_prefill_size=16)
    report = compile_model("small-mixtral", cfg, "bfloat16", "v5e:2x2", 2, ec=ec,
                           kv_pages=1025, which=[("forward", 16)])
    assert report["compiled"], [p["error"] for p in report["programs"]]
    assert report["experts"] == ["gather"]
    params = report["params"]
    assert params["held_bytes"] == params["checkpoint_bytes"]
    assert params["held_bytes_per_chip"] < 0.6 * params["held_bytes"]
    (p,) = report["programs"]
    ops = {(c["op"], c["dtype"]) for c in p["collectives"]}
    assert not {o for o in ops if o[0] in ("all-reduce", "reduce-scatter")
                and o[1] in ("f32", "bf16", "f16")}, ops  # no float sum across chips


def test_compile_report_text(capsys: pytest.CaptureFixture[str]) -> None:
    report = _report("v5e:2x2", 4, (("forward", 16),), layers=2)
    print_compile_report({"topology": "v5e:2x2", "tp": 4, "host_platform": "cpu",
                          "jax": "?", "models": [report], "compiled": report["compiled"]})
    out = capsys.readouterr().out
    assert "TPU v5 lite x4" in out and "COMPILED: True" in out
    assert out.count("ratio ") == 1 and "all-gather bf16 x" in out


def test_the_command_refuses_what_it_cannot_compile(capsys: pytest.CaptureFixture[str]) -> None:
    """`doctor --compile` is the TPU compiler's: another target is refused, and a topology
    libtpu does not know is an error naming it (exit 1), not a traceback."""
    from multiserve.cli import main

    assert main(["doctor", "--target", "cuda", "--compile"]) == 2
    assert "the TPU compiler only" in capsys.readouterr().out
    assert main(["doctor", "--target", "tpu", "--compile", "--topology", "v9x:3x3"]) == 1
    assert "no TPU compiler for topology 'v9x:3x3'" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["small-gemma2", "small-gpt-oss"])
def test_windowed_families_compile_with_the_tpu_kernel(family: str) -> None:
    """Gemma 2's sliding windows, soft cap and score scale (its decoder scanned: the
    window a traced scalar per layer) and GPT-OSS's sinks and windows beside its experts
    (unrolled; its two expert products a layer by the TPU's grouped matmul,
    kernels/grouped_tpu.py) compile for v5e with our Mosaic attention kernel in every
    layer, not the XLA formulation; each weight held once (GPT-OSS's experts as per-layer
    stacks, the rest read as slices of the canonical stacks)."""
    from multiserve.bench.random_model import SIZES

    cfg = replace(SIZES[family], vocab_size=4096)
    ec = replace(EC, precompile_token_paddings=(16,), chunked_prefill_size=16)
    report = compile_model(family, cfg, "bfloat16", "v5e:2x2", 1, ec=ec, kv_pages=1025,
                           which=[("forward", 16)])
    assert report["compiled"], [p["error"] for p in report["programs"]]
    assert report["attention"] == "pallas_tpu"
    assert report["params"]["held_bytes"] == report["params"]["checkpoint_bytes"]
    assert report["experts"] == (["gmm"] if cfg.num_experts else [])
    (p,) = report["programs"]
    per_layer = 1 + (2 if cfg.num_experts else 0)  # attention, and the expert products
    assert p["pallas_calls"] == (1 if p["scanned"] else per_layer * cfg.num_layers), \
        p["pallas_calls"]
