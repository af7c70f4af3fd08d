"""Serving before every step program is compiled (EngineConfig.compile_in_background).

An engine serves as soon as its covering buckets (the largest token and row buckets) are
compiled and compiles the smaller ones while it serves. Outputs must not change when the
smaller buckets arrive (the model is row-invariant at every bucket), no step may ever
compile, and shutting down must not wait for the remaining compiles nor let them run.

The tests hold every background compile slot (`programs.background_compiles_held`, as the
fleet launcher does while it builds its engines) to keep an engine in its "covering
buckets only" state for as long as they need, then release it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import WAIT_S
from shipped_engine import SHIPPED_FUSED_STEP_MAX

from multiserve.config import EngineConfig
from multiserve.engine.device.programs import background_compiles_held, plan
from multiserve.model.kernels import native as native_kernels
from multiserve.types import SamplingParams

# fused decode programs ("S") as configs/cpu-4.toml has them: for 1-2 row decodes only
BUCKETS: dict[str, Any] = dict(
    precompile_token_paddings=(1, 8, 64, 128), precompile_bs_paddings=(1, 8, 64),
    max_running_requests=64, chunked_prefill_size=64, page_size=8, max_total_tokens=8192,
    max_context_len=1024, show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                            return_logprob=True, top_logprobs_num=2)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, ignore_eos=True,
                             return_logprob=True, seed=7)
    return [([5, 17, 42, 99, 7], greedy), ([3, 3, 8] * 9, sampled), ([11, 12, 13], greedy)]


def _run(engine: Any) -> list[tuple[Any, Any]]:
    """Each request alone (1-token decode steps), then all together (a batch)."""
    reqs = _requests()
    alone = [engine.generate(input_ids=ids, sampling_params=p) for ids, p in reqs]
    together = engine.generate(input_ids=[ids for ids, _ in reqs],
                               sampling_params=[p for _, p in reqs])
    return [(o.output_ids, o.logprobs) for o in (*alone, *together)]


def test_plan_serves_from_the_covering_buckets_and_compiles_small_ones_first() -> None:
    tokens, rows = (1, 2, 8, 64, 128, 512), (1, 8, 64, 128)
    order = plan(tokens, rows, unroll_max_tokens=64, background=True)
    assert set(order.first) == {("T", 128), ("T", 512), ("R", 128)}
    assert list(order.rest) == [("T", 1), ("R", 1), ("T", 2), ("T", 8), ("R", 8), ("T", 64),
                                ("R", 64)]
    blocking = plan(tokens, rows, unroll_max_tokens=64, background=False)
    assert blocking.rest == () and len(blocking.first) == len(tokens) + len(rows)
    # fused decode steps: never needed to serve; after their T and R, at equal size
    fused = plan(tokens, rows, unroll_max_tokens=64, background=True, fused=(1, 8, 128))
    assert fused.first == order.first
    assert list(fused.rest) == [("T", 1), ("R", 1), ("S", 1), ("T", 2), ("T", 8), ("R", 8),
                                ("S", 8), ("T", 64), ("R", 64), ("S", 128)]
    assert plan(tokens, rows, 64, background=False, fused=(8,)).first[-1] == ("S", 8)
    # K decode steps a dispatch: after the fused step of their size
    steps = plan(tokens, rows, 64, background=True, fused=(1, 8), decode_steps=(1, 8))
    assert list(steps.rest) == [("T", 1), ("R", 1), ("S", 1), ("M", 1), ("T", 2), ("T", 8),
                                ("R", 8), ("S", 8), ("M", 8), ("T", 64), ("R", 64)]
    # no scanned bucket: the largest (unrolled) token bucket covers
    small = plan((1, 16), (1, 16), unroll_max_tokens=64, background=True)
    assert set(small.first) == {("T", 16), ("R", 16)} and small.rest == (("T", 1), ("R", 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_change_when_the_small_buckets_arrive(
        dtype: str, request: pytest.FixtureRequest) -> None:
    """In both compute dtypes: the bfloat16 checkpoint served in bfloat16 (native kernels)
    keeps the same row invariance across buckets as the float32 one."""
    from multiserve.engine.engine import Engine

    if dtype == "bfloat16" and native_kernels.unavailable_reason("bfloat16") is not None:
        pytest.skip("the native bfloat16 kernels do not run here")
    model_dir = request.getfixturevalue(
        "tiny_model_dir" if dtype == "float32" else "tiny_model_dir_bf16")
    with background_compiles_held():
        engine = Engine(EngineConfig(model_path=str(model_dir), dtype=dtype, **BUCKETS))
        try:
            assert engine.get_internal_state()["dtype"] == dtype
            status = engine.get_internal_state()["compile"]
            assert status == engine.compile_status()
            assert status["compiled"] == ["T=128", "R=64"], status
            assert status["pending"] == ["T=1", "R=1", "S=1", "T=8", "R=8", "T=64"]
            assert status["complete_s"] is None and not engine.wait_compiled(0.05)
            covering_only = _run(engine)  # every step padded to 128 tokens / 64 rows
            assert all(ids and lps for ids, lps in covering_only)
        except BaseException:
            engine.shutdown()
            raise
    try:
        assert engine.wait_compiled(WAIT_S)
        status = engine.get_internal_state()["compile"]
        assert status["pending"] == [] and status["error"] is None
        assert status["compiled"] == ["T=1", "T=8", "T=64", "T=128", "R=1", "R=8", "R=64",
                                      "S=1"]
        assert status["rejected"] == []
        assert status["complete_s"] >= status["ready_s"] > 0
        assert _run(engine) == covering_only  # lone requests now decode at T = R = 1
        assert engine.get_internal_state()["cache_miss_count"] == 0
    finally:
        engine.shutdown()


def test_blocking_warm_up_compiles_every_bucket_before_serving(tiny_model_dir: Path) -> None:
    from multiserve.engine.engine import Engine

    with background_compiles_held():  # the blocking warm-up does not need a background slot
        engine = Engine(EngineConfig(model_path=str(tiny_model_dir),
                                     compile_in_background=False, **BUCKETS))
    try:
        status = engine.get_internal_state()["compile"]
        assert status["pending"] == [] and len(status["compiled"]) == 8
        assert engine.wait_compiled(0)
    finally:
        engine.shutdown()


def test_shutdown_does_not_wait_for_pending_compiles(tiny_model_dir: Path) -> None:
    from multiserve.engine.engine import Engine

    with background_compiles_held():
        engine = Engine(EngineConfig(model_path=str(tiny_model_dir), **BUCKETS))
        assert engine.compile_status()["compiling"]
        done = threading.Event()
        threading.Thread(target=lambda: (engine.shutdown(), done.set()), daemon=True).start()
        # shutdown stops the background before a pending program starts: it returns while
        # the slots are still held, and the compile thread ends without compiling more
        assert done.wait(WAIT_S), "shutdown waited for the background compiles"
        deadline = time.monotonic() + WAIT_S
        while engine.compile_status()["compiling"] and time.monotonic() < deadline:
            time.sleep(0.02)
        status = engine.compile_status()
        assert not status["compiling"] and status["pending"], status
    # slots free again: the compiling thread has ended (the only one that compiles for this
    # engine), so nothing more is compiled for the stopped engine
    after = engine.compile_status()
    assert not after["compiling"] and after["compiled"] == status["compiled"]
    assert not engine.wait_compiled(0)


# A user's script: an engine compiling its small buckets in the background, a request
# generating on another thread, and then the script raises. The slots are held until the
# raise, so a compile is in progress (and others pending) when the interpreter exits.
_RAISING_SCRIPT = """
import atexit, json, sys, threading

def _final_status():  # registered before multiserve: runs after its exit hooks
    print("EXIT-STATUS " + json.dumps(engine.compile_status()), file=sys.stderr, flush=True)

atexit.register(_final_status)

from multiserve import Engine, EngineConfig, SamplingParams
from multiserve.engine.device.programs import background_compiles_held

stepping = threading.Event()

def generate_forever():
    params = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    try:
        while True:
            engine.generate(input_ids=[5, 17, 42], sampling_params=params)
            stepping.set()
    except Exception:  # the engine is shut down at exit
        pass

with background_compiles_held():
    engine = Engine(EngineConfig(model_path=sys.argv[1], **json.loads(sys.argv[2])))
    assert engine.compile_status()["pending"], "nothing left to compile in the background"
    threading.Thread(target=generate_forever, daemon=True).start()
    assert stepping.wait(120)
    engine.generate(input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=-1.0))
"""


def test_a_script_raising_while_compiles_run_exits_with_its_traceback(
        tiny_model_dir: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    # no persistent compile cache: the compiles take as long as a first start's
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    out = subprocess.run(
        [sys.executable, "-c", _RAISING_SCRIPT, str(tiny_model_dir), json.dumps(BUCKETS)],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback (most recent call last)" in out.stderr, out.stderr[-3000:]
    assert "SamplingParamsError: temperature" in out.stderr, out.stderr[-3000:]
    assert "terminate called" not in out.stderr and "FATAL" not in out.stderr
    # exit stopped the background compiles (waiting only for one in progress) and the engine
    final = json.loads(out.stderr.split("EXIT-STATUS ", 1)[1].splitlines()[0])
    assert final["pending"] and not final["compiling"], final
