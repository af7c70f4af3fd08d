"""Fused steps (EngineConfig.fused_step_paddings): a step padded to b tokens and b rows runs
forward, head and sampler as ONE program, checked bit for bit against the forward and head
programs when it is primed (engine/device/step_programs.py); and K decode steps per
dispatch (EngineConfig.decode_steps_per_dispatch): a loop of such steps in one program,
checked against as many single steps.

Behaviour under test: outputs (ids, logprobs, top logprobs) are bitwise those of an engine
without fused steps, in both compute dtypes, for greedy, seeded sampling and penalties,
alone and batched, with one step or four per dispatch; a fused or decode-steps program whose
check fails is never used; one compiled while the engine's memory is released is checked
and used once memory is resumed; a stop inside a dispatch's steps ends the output there,
and a pause lands between dispatches.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import WAIT_S, AtTokens, Collector, Trigger, assert_idle_and_clean

from multiserve.config import EngineConfig
from multiserve.engine.device.programs import ProgramKind, background_compiles_held
from multiserve.model.kernels import native as native_kernels
from multiserve.types import SamplingParams

BUCKETS: dict[str, Any] = dict(
    precompile_token_paddings=(1, 4, 32), precompile_bs_paddings=(1, 4),
    max_running_requests=4, chunked_prefill_size=16, page_size=8, max_total_tokens=4096,
    max_context_len=512, show_progress=False)
FUSED = ["S=1", "S=4"]
_REFERENCE: dict[str, list[tuple[Any, ...]]] = {}  # outputs without fused steps, by dtype


def _requests() -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                            return_logprob=True, top_logprobs_num=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_new_tokens=10,
                             ignore_eos=True, return_logprob=True, seed=11)
    penalised = SamplingParams(temperature=0.7, max_new_tokens=10, ignore_eos=True,
                               frequency_penalty=0.5, presence_penalty=0.3,
                               repetition_penalty=1.2, return_logprob=True, seed=3)
    return [([5, 17, 42, 99, 7], greedy), ([3, 3, 8] * 7, sampled), ([11, 12, 13], penalised)]


def _outputs(engine: Any) -> list[tuple[Any, ...]]:
    """Each request alone (1-token steps), then the three together (4-row steps)."""
    reqs = _requests()
    alone = [engine.generate(input_ids=ids, sampling_params=p) for ids, p in reqs]
    together = engine.generate(input_ids=[ids for ids, _ in reqs],
                               sampling_params=[p for _, p in reqs])
    return [(o.output_ids, tuple((t.token_id, t.logprob, t.top) for t in o.logprobs))
            for o in (*alone, *together)]


def _reference(dtype: str, model: str) -> list[tuple[Any, ...]]:
    """`_outputs` of an engine without fused steps (one per dtype and test process)."""
    from multiserve.engine.engine import Engine

    if dtype not in _REFERENCE:
        engine = Engine(EngineConfig(model_path=model, dtype=dtype, fused_step_paddings=(),
                                     compile_in_background=False, **BUCKETS))
        try:
            assert engine.get_internal_state()["forward_ct_fused"] == 0
            _REFERENCE[dtype] = _outputs(engine)
            assert engine.get_internal_state()["forward_ct_fused"] == 0
            assert not any(c.startswith("S=") for c in engine.compile_status()["compiled"])
        finally:
            engine.shutdown()
    return _REFERENCE[dtype]


def _model_dir(dtype: str, request: pytest.FixtureRequest) -> str:
    if dtype == "bfloat16" and native_kernels.unavailable_reason("bfloat16") is not None:
        pytest.skip("the native bfloat16 kernels do not run here")
    return str(request.getfixturevalue(
        "tiny_model_dir" if dtype == "float32" else "tiny_model_dir_bf16"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_give_the_outputs_of_the_two_programs(
        dtype: str, request: pytest.FixtureRequest) -> None:
    from multiserve.engine.engine import Engine

    model = _model_dir(dtype, request)
    engine = Engine(EngineConfig(model_path=model, dtype=dtype, compile_in_background=False,
                                 **BUCKETS))
    try:
        fused = _outputs(engine)
        state = engine.get_internal_state()
        assert state["compile"]["rejected"] == []
        assert [c for c in state["compile"]["compiled"] if c.startswith("S=")] == FUSED
        # 9 decode steps per request alone (T = R = 1), and the batch's decode steps
        # (T = R = 4) once no row is still in its prefill (at least 8 of its 9)
        assert state["forward_ct_fused"] >= 3 * 9 + 8
    finally:
        engine.shutdown()
    assert all(ids and lps for ids, lps in fused)
    assert all(len(t[2]) == 3 for t in fused[0][1])  # the greedy request's top 3
    assert fused == _reference(dtype, model)


def test_a_fused_program_that_differs_is_rejected_and_never_run(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multiserve.engine.device.step_programs import StepPrograms
    from multiserve.engine.engine import Engine

    expected = _reference("float32", str(tiny_model_dir))
    # this backend's fused programs all agree; make the check see a difference
    monkeypatch.setattr(StepPrograms, "fused_step_agrees", lambda self, size, program: False)
    engine = Engine(EngineConfig(model_path=str(tiny_model_dir), compile_in_background=False,
                                 **BUCKETS))
    try:
        status = engine.compile_status()
        assert status["rejected"] == FUSED and status["pending"] == []
        assert not any(c.startswith("S=") for c in status["compiled"])
        assert engine.wait_compiled(0)
        assert _outputs(engine) == expected
        assert engine.get_internal_state()["forward_ct_fused"] == 0
    finally:
        engine.shutdown()


def test_a_fused_program_compiled_while_memory_is_released_is_checked_on_resume(
        tiny_model_dir: Path) -> None:
    from multiserve.engine.engine import Engine

    with background_compiles_held():  # serve from the covering buckets only
        engine = Engine(EngineConfig(model_path=str(tiny_model_dir), **BUCKETS))
    try:
        assert engine.release_memory_occupation().ok
        deadline = time.monotonic() + WAIT_S
        while (engine.compile_status()["compiling"] or engine.compile_status()["pending"] !=
               FUSED) and time.monotonic() < deadline:
            time.sleep(0.05)
        status = engine.compile_status()
        # every forward and head is in; the fused steps wait for weights and KV to check
        assert status["pending"] == FUSED and status["error"] is None, status
        assert not engine.wait_compiled(0)
        assert engine.resume_memory_occupation().ok
        assert engine.wait_compiled(WAIT_S)
        status = engine.compile_status()
        assert status["pending"] == [] and status["rejected"] == []
        assert [c for c in status["compiled"] if c.startswith("S=")] == FUSED
        before = engine.get_internal_state()["forward_ct_fused"]
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=6, ignore_eos=True))
        assert len(out.output_ids) == 6
        assert engine.get_internal_state()["forward_ct_fused"] - before >= 5
    finally:
        engine.shutdown()


def test_the_check_sees_one_ulp(tiny_model_dir: Path) -> None:
    """The prime's check on the real fused program passes; on one whose raw logprobs are
    one ulp off, or whose sampled ids differ, it fails."""
    import jax
    import numpy as np

    from multiserve.engine.commands import Call
    from multiserve.engine.engine import Engine

    def nudged(program: Any, which: str) -> Any:
        def run(*args: Any) -> Any:
            next_ids, out, kv = program(*args)
            if which == "logprob":
                out = out.replace(logprob=np.nextafter(np.asarray(out.logprob), np.float32(0)))
            else:
                next_ids = np.asarray(next_ids) + 1
            return next_ids, out, kv
        return run

    def check(core: Any) -> list[bool]:
        runner = core.runner
        programs = runner.step_programs
        verdicts = []
        for size in (1, 4):
            program = runner.programs.get(ProgramKind.FUSED, size)
            verdicts += [programs.fused_step_agrees(size, program),
                         programs.fused_step_agrees(size, nudged(program, "logprob")),
                         programs.fused_step_agrees(size, nudged(program, "ids"))]
        jax.block_until_ready(runner.kv)
        return verdicts

    engine = Engine(EngineConfig(model_path=str(tiny_model_dir), compile_in_background=False,
                                 **BUCKETS))
    try:
        assert engine.call(Call(check)).result() == [True, False, False] * 2
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=4, ignore_eos=True))
        assert len(out.output_ids) == 4  # the pool the checks ran on still serves
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_four_steps_per_dispatch_give_the_outputs_of_single_steps(
        dtype: str, request: pytest.FixtureRequest, trigger: Trigger) -> None:
    """Greedy and seeded requests alone run 4 decode steps a dispatch (the penalised one and
    the batch holding it run single steps; sizes 1 only, the fused and decode-steps
    programs of one row: the fewest compiles); the outputs are bitwise those of single
    steps. Then (float32): a stop token sampled inside a dispatch ends the output there;
    a pause lands between dispatches; the prime's check sees one ulp."""
    from multiserve.engine.engine import Engine

    model = _model_dir(dtype, request)
    engine = Engine(EngineConfig(model_path=model, dtype=dtype, compile_in_background=False,
                                 decode_steps_per_dispatch=4,
                                 **{**BUCKETS, "fused_step_paddings": (1,)}))
    try:
        outputs = _outputs(engine)
        state = engine.get_internal_state()
        assert state["compile"]["rejected"] == []
        assert [c for c in state["compile"]["compiled"] if c[0] in "SM"] == ["S=1", "M=1"]
        # greedy and seeded alone: 9 tokens after the prefill's, in 3 dispatches each
        assert state["forward_ct_decode_steps"] >= 6
        assert outputs == _reference(dtype, model)
        if dtype == "float32":
            _check_stop_inside_a_dispatch(engine, outputs[0][0])
            _check_pause_between_dispatches(engine, trigger, outputs[0][0])
            _check_the_decode_steps_check_sees_one_ulp(engine)
            assert_idle_and_clean(engine)
    finally:
        engine.shutdown()


def _check_stop_inside_a_dispatch(engine: Any, greedy_ids: tuple[int, ...]) -> None:
    """The greedy request with a stop id its output reaches at index i (inside the second
    dispatch, steps after it): the output ends at i, finish reason "stop"."""
    stop = greedy_ids[6]
    i = greedy_ids.index(stop)
    assert 1 <= i <= 8, greedy_ids  # sampled by a dispatch, not the last of its steps
    ids, params = _requests()[0]
    before = engine.get_internal_state()["forward_ct_decode_steps"]
    out = engine.generate(input_ids=ids, sampling_params=params.with_updates(
        stop_token_ids=(stop,)))
    assert out.output_ids == greedy_ids[:i + 1]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert engine.get_internal_state()["forward_ct_decode_steps"] > before


def _check_pause_between_dispatches(engine: Any, trigger: Trigger,
                                    greedy_ids: tuple[int, ...]) -> None:
    """Paused (retract) once the greedy request has 3 tokens, then continued: the same
    output (re-prefilled from prompt and output, then 4 steps a dispatch again)."""
    ids, params = _requests()[0]
    hook = AtTokens(trigger, "r0", 3,
                    lambda: engine.acontrol("pause_generation", mode="retract"))
    col = Collector(engine, on_output=hook)
    col.submit("r0", ids, params)
    (res,) = hook.wait()
    assert res.ok and res.details["retracted"] == 1
    assert engine.get_internal_state()["engine_paused"]
    assert engine.continue_generation().ok
    assert col.wait()[("r0", 0)].output_ids == greedy_ids


def _check_the_decode_steps_check_sees_one_ulp(engine: Any) -> None:
    """The prime's check on the real decode-steps program passes; on one whose last
    step's raw logprobs are one ulp off it fails."""
    import jax
    import numpy as np

    from multiserve.engine.commands import Call

    def nudged(program: Any) -> Any:
        def run(*args: Any) -> Any:
            last, ids, out, kv = program(*args)
            logprob = np.asarray(out.logprob).copy()
            logprob[-1] = np.nextafter(logprob[-1], np.float32(0))
            return last, ids, out.replace(logprob=logprob), kv
        return run

    def check(core: Any) -> list[bool]:
        runner = core.runner
        program = runner.programs.get(ProgramKind.DECODE_STEPS, 1)
        verdicts = [runner.step_programs.decode_steps_agree(1, program),
                    runner.step_programs.decode_steps_agree(1, nudged(program))]
        jax.block_until_ready(runner.kv)
        return verdicts

    assert engine.call(Call(check)).result() == [True, False]


def test_fused_step_sizes_must_be_in_both_paddings_lists() -> None:
    from multiserve.config import ConfigError

    assert EngineConfig(**BUCKETS).fused_step_sizes == (1, 4)
    assert EngineConfig(**BUCKETS, fused_step_paddings=(4, 1, 1)).fused_step_sizes == (1, 4)
    assert EngineConfig(**BUCKETS, fused_step_paddings=()).fused_step_sizes == ()
    with pytest.raises(ConfigError, match="fused_step_paddings"):
        EngineConfig(**BUCKETS, fused_step_paddings=(32,))  # no 32-row head
