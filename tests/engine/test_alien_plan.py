"""An engine on an alien backend's plan keeps the pause-proof identity.

The calibration is made to see an alien backend (tests/model/test_calibration.py's
`alien`: products below 16 rows each sum in their own order, 1- and 2-row attention
chunks differ, row sums below 8 rows differ), so it picks the fallback formulations
(products padded to >= 16 rows, chunks of >= 4 rows, row sums padded to >= 8). The engine
is then pinned to that plan (EngineConfig.invariance_plan) and must still give a lone
request bitwise the same ids and logprobs after a pause in every mode, after abort +
resubmit, and inside a batch, as uninterrupted and alone; in float32 and in bfloat16 (the
bfloat16 checkpoint, its plan calibrated for bfloat16).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import AtTokens, Collector, Trigger, ids_and_logprobs

from multiserve.config import EngineConfig
from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.workload import workload_for
from multiserve.model.kernels import native as native_kernels
from multiserve.types import SamplingParams

# No fused programs: a fused program runs only once its priming check found it gives the
# bits of the forward and head programs it replaces, so the outputs checked here are those
# programs' bits with or without it (the check itself: tests/engine/test_fused_step.py);
# each fused program is a compile of the three together. Token buckets: 1 (a lone decode
# row: every product padded to the plan's 16 rows), 16 (the batch's decode rows and the
# prompts: the padded size itself) and 64 (several prompts at once); each bucket is a
# forward program of the XLA formulations (~10 s to compile here).
ENGINE = dict(precompile_token_paddings=(1, 16, 64), precompile_bs_paddings=(1, 4, 16),
              max_running_requests=16, chunked_prefill_size=64, page_size=8,
              max_total_tokens=4096, max_context_len=512, show_progress=False,
              compile_in_background=False, fused_step_paddings=())


def alien(primitive: str, c: dict) -> bool:
    if primitive == "product":
        return c["rows"] < 16
    if primitive == "attention":
        return c["chunk"] <= 2
    return c["rows"] < 8


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def alien_engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The engine pinned to the alien backend's plan, in each compute dtype (bfloat16: the
    bfloat16 checkpoint, its formulations probed in bfloat16)."""
    from multiserve.engine.engine import Engine
    from multiserve.model.loading.loader import load_model

    dtype = request.param
    if dtype == "bfloat16" and native_kernels.unavailable_reason("bfloat16") is not None:
        pytest.skip("the native bfloat16 kernels do not run here")
    model_dir = request.getfixturevalue(
        "tiny_model_dir" if dtype == "float32" else "tiny_model_dir_bf16")
    cfg = load_model(str(model_dir), dtype).config
    workload = workload_for(cfg, ENGINE["precompile_token_paddings"],
                            ENGINE["precompile_bs_paddings"], 16, 8, 128, jnp.dtype(dtype),
                            engine_defaults=False)  # the engine's own sizes: all it runs
    plan = calibrate(workload, jax.devices()[0], distort=alien).plan
    assert plan.verified
    assert all(f.rows >= 16 for p in plan.products for _, f in p.by_rows)
    assert all(chunk >= 4 for _, (chunk, _) in plan.attention.by_tokens)
    eng = Engine(EngineConfig(model_path=str(model_dir), invariance_plan=plan, dtype=dtype,
                              **ENGINE))
    try:
        assert eng.get_internal_state()["dtype"] == dtype
        yield eng
    finally:
        eng.shutdown()


PROMPTS = [[5, 17, 42, 99, 7, 8], [3, 3, 8] * 5, [11, 12, 13], [40, 41]]


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True,
                              return_logprob=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_new_tokens=14,
                          ignore_eos=True, return_logprob=True)


def _alone(engine: Any, i: int) -> tuple:
    col = Collector(engine)
    col.submit_all([PROMPTS[i]], [_params(i)])
    return next(iter(ids_and_logprobs(col.wait()).values()))


def test_the_engine_reports_the_pinned_plan(alien_engine: Any) -> None:
    det = alien_engine.get_internal_state()["determinism"]
    assert det["key_hash"] == "pinned" and det["verified"]
    assert all(rows >= 16 for p in det["plan"]["products"] for _, _, rows, *_ in p["by_rows"])


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_proof_identity_on_the_alien_plan(alien_engine: Any, trigger: Trigger,
                                                mode: str, i: int) -> None:
    want = _alone(alien_engine, i)
    hook = AtTokens(trigger, "r0", 5, lambda: alien_engine.acontrol("pause_generation", mode=mode))
    col = Collector(alien_engine, on_output=hook)
    col.submit_all([PROMPTS[i]], [_params(i)])
    (res,) = hook.wait()
    assert res.ok
    if mode == "abort":
        (ids, lps), = ids_and_logprobs(col.wait()).values()
        assert (ids, lps) == (want[0][:len(ids)], want[1][:len(ids)]) and len(ids) < 14
        assert alien_engine.continue_generation().ok
        assert _alone(alien_engine, i) == want
        return
    assert alien_engine.continue_generation().ok
    assert next(iter(ids_and_logprobs(col.wait()).values())) == want


def test_a_batch_equals_each_request_alone_on_the_alien_plan(alien_engine: Any) -> None:
    alone = [_alone(alien_engine, i) for i in range(len(PROMPTS))]
    col = Collector(alien_engine)
    col.submit_all(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    together = ids_and_logprobs(col.wait())
    assert [together[(f"r{i}", 0)] for i in range(len(PROMPTS))] == alone
