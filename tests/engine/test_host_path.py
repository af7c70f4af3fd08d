"""The step's host path (issue 50, item 3): the per-phase host timer (engine/host_phases.py)
on a real tiny engine, the values the step path builds without their frozen __init__
(engine/base/frozen_build.py) equal to what the constructor builds, and the sampler inputs
it keeps (SamplingParams.sampler_fields, engine/step_inputs/steady_rows.py) equal to a
rebuild."""

from __future__ import annotations

import dataclasses
import queue
from typing import Any

import numpy as np
import pytest
from engine_helpers import WAIT_S, held
from sched_sim import PAGE, Sim

from multiserve.engine.base.frozen_build import built
from multiserve.engine.commands import Call
from multiserve.engine.host_phases import PHASES, WAIT_PHASES, HostPhases
from multiserve.engine.sampling.sampler import SamplingBatch
from multiserve.engine.sched.batch import BatchRow
from multiserve.engine.sched.request import Req
from multiserve.engine.sched.stop_rules import StopRules
from multiserve.engine.step_inputs.row_specs import step_rows
from multiserve.engine.step_inputs.sampling_batch import (
    RowSpec,
    build_sampling_batch,
    mask_words,
    mask_zeros,
    penalty_zeros,
)
from multiserve.engine.step_inputs.steady_rows import SteadyRows
from multiserve.engine.step_inputs.token_arrays import (
    build_step_arrays,
    empty_step_arrays,
    one_token_rows,
    row_by_row,
)
from multiserve.types import GenerateRequest, OutputDelta, SamplingParams


def _req() -> Req:
    request = GenerateRequest(rid="r", input_ids=(5, 6, 7),
                              sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    return Req.samples_of(request, 3, lambda _: None)[0]


def test_built_values_equal_the_constructors_and_stay_frozen() -> None:
    req = _req()
    values: list[tuple[type, dict[str, Any]]] = [
        (BatchRow, dict(req=req, start=3, end=4, samples=True, from_prev=True, draft=())),
        (RowSpec, dict(params=req.params, seed=3, sample_index=0, position=4,
                       output_ids=[9], prompt_ids=[5, 6, 7], ban_ids=(2,), token_mask=None)),
    ]
    for cls, kw in values:
        made = built(cls, **kw)
        assert type(made) is cls and made == cls(**kw)
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.start = 0  # type: ignore[attr-defined]
    with pytest.raises(AssertionError):
        built(BatchRow, req=req, start=3, end=4, samples=True, from_prev=True)  # no draft


def test_next_delta_names_every_field_of_output_delta() -> None:
    req = _req()
    req.output_ids += [11, 12]
    delta = req.next_delta("v1")
    names = {f.name for f in dataclasses.fields(OutputDelta)}
    assert set(vars(delta)) == names
    assert delta == OutputDelta(**{n: getattr(delta, n) for n in names})
    assert delta.new_ids == (11, 12) and delta.start == 0 and req.sent == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        delta.start = 1  # type: ignore[misc]


def test_host_phases_tile_each_pass_of_a_real_run(tiny_engine: Any) -> None:
    """With a HostPhases on the core, every step pass of a run is filed (decode passes
    with their rows), its phases add up to its wall time, and the summary is per pass;
    taking it off leaves the core without one."""
    def switch(on: bool) -> Any:
        def run(core: Any) -> Any:
            phases, core.host_phases = core.host_phases, HostPhases() if on else None
            return phases
        return tiny_engine.call(Call(run)).result()

    def reused() -> int:
        return tiny_engine.call(Call(lambda core: core.inputs.steady_rows.reused)).result()

    switch(True)
    reused_before = reused()
    outs: list[queue.SimpleQueue[Any]] = []
    with held(tiny_engine):  # the four start in one step, so some decode pass has all four
        for i in range(4):
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            outs.append(q)
            tiny_engine.submit(GenerateRequest(
                rid=f"phases-{i}", input_ids=tuple(range(3 + i, 20 + i)),
                sampling=SamplingParams(max_new_tokens=12, ignore_eos=True), stream=True),
                q.put)
    for q in outs:
        while not q.get(timeout=WAIT_S).finished:
            pass
    phases = switch(False)
    assert isinstance(phases, HostPhases)
    assert tiny_engine.call(Call(lambda core: core.host_phases)).result() is None
    assert phases.decode and phases.other  # the prefill pass(es), then decode passes
    assert max(phases.rows) == 4 and len(phases.rows) == len(phases.decode)
    for row in phases.decode + phases.other:
        assert len(row) == len(PHASES) and min(row) >= 0.0
    summary = phases.summary()
    decode = summary["decode"]
    assert decode["passes"] == len(phases.decode)
    assert set(decode["phase_ms"]) == set(PHASES)
    wall = decode["wall_ms"]
    waits = sum(decode["phase_ms"][p] for p in WAIT_PHASES)
    assert decode["host_ms"] == pytest.approx(wall - waits)
    # one decode step a dispatch: host time per decode step is the pass's
    assert set(phases.decode_steps) == {1} and decode["decode_steps_p50"] == 1
    assert decode["host_per_step_ms"] == pytest.approx(decode["host_ms"])
    assert wall == pytest.approx(sum(decode["phase_ms"].values()))
    # the steady decode steps of the same four samples took the step before's sampler
    # inputs (engine/step_inputs/steady_rows.py)
    assert reused() > reused_before


def test_a_decode_steps_arrays_are_what_row_by_row_writes() -> None:
    """`one_token_rows` (every row one token) writes the values `row_by_row` writes, for
    rows whose input id is on the host (its prompt or its output) and rows whose id is
    the previous step's device row, LoRA slots included; build_step_arrays picks it."""
    sim = Sim(num_pages=64, max_tokens=64, max_rows=8)
    reqs = [sim.req(f"r{i}", range(3 + i, 9 + 2 * i), max_new=20) for i in range(5)]
    sim.add(*reqs)
    for _ in range(4):  # prefill, then decode steps: some rows cross a page boundary
        sim.step()
    batch = sim.sched.schedule()
    assert batch is not None and batch.num_tokens == len(batch.rows) == 5
    reqs[1].pending, reqs[1].last_out_row = 1, 3  # its input id: device row 3
    reqs[2].lora_slot = 2
    rows = [(r.req, r.start) for r in batch.rows]
    assert any(start >= len(req.prompt_ids) for req, start in rows)  # read from output
    batch = type(batch).of([type(r)(r.req, r.start, r.end, r.samples, r.req is reqs[1])
                            for r in batch.rows])
    fast, slow = (empty_step_arrays(8, 8, 8, 16, lora=True) for _ in range(2))
    one_token_rows(batch, fast, PAGE)
    row_by_row(batch, slow, PAGE)
    for name in ("input_ids", "from_prev", "positions", "token_seq", "out_slots",
                 "page_table", "seq_lens", "lora_slots"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), name)
    assert fast.from_prev[1] == 3 and fast.lora_slots[2] == 2
    built_arrays = build_step_arrays(batch, 8, 8, 8, 16, PAGE, lora=True)
    np.testing.assert_array_equal(built_arrays.out_slots, slow.out_slots)


def test_sampling_rows_are_stored_alike_with_and_without_padding_rows() -> None:
    """The sampler's host inputs of the rows present are the same whether they are rows
    0..n-1 (one slice store per field) or sit among padding rows (index stores); greedy
    rows keep the neutral filter values, a sampled row its own."""
    def spec(seed: int, **params: Any) -> RowSpec:
        return RowSpec(params=SamplingParams(**params), seed=seed, sample_index=seed % 3,
                       position=10 + seed % 50, output_ids=(), prompt_ids=(),
                       ban_ids=(2, 7) if seed == 2**40 + 1 else ())
    specs = [spec(1, temperature=0.0),
             spec(2**40 + 1, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
             spec(5, temperature=1.0, top_k=0, frequency_penalty=0.0, top_logprobs_num=2)]
    dense = build_sampling_batch(specs, 8, 64)
    padded = build_sampling_batch([specs[0], None, specs[1], specs[2]], 8, 64)
    for name in ("temperature", "top_k", "top_p", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "seed_hi", "seed_lo",
                 "sample_index", "position", "banned_ids", "top_logprobs_num",
                 "logprob_token_ids"):
        d, p = np.asarray(getattr(dense, name)), np.asarray(getattr(padded, name))
        np.testing.assert_array_equal(d[:3], p[[0, 2, 3]], name)
        np.testing.assert_array_equal(d[4:], p[4:], name)  # padding rows
    assert dense.top_k[0] == 0 and dense.top_p[0] == 1.0 and dense.temperature[0] == 0.0
    assert dense.top_k[1] == 5 and dense.temperature[1] == np.float32(0.7)
    assert (dense.seed_hi[1], dense.seed_lo[1]) == (2**8, 1)
    assert list(dense.banned_ids[1][:3]) == [2, 7, -1]
    assert bool(dense.any_logprobs) and bool(dense.any_sampled) and bool(dense.any_filter)


def test_sampler_fields_kept_per_params_store_what_each_row_asks() -> None:
    """The sampler's per-row fields come from each SamplingParams' kept `sampler_fields`
    (computed once per params object): the stored rows equal, value for value, element
    stores of each params' own fields with greedy folded in and a top_k outside
    (0, vocab) off; a params changed by `with_updates` carries its own fields."""
    vocab = 64
    cases = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2),
             SamplingParams(temperature=0.7, top_k=1, top_p=0.9),  # greedy by top_k
             SamplingParams(temperature=0.1, top_k=vocab, top_p=0.3, min_p=0.1),
             SamplingParams(temperature=1, top_k=-1, frequency_penalty=0.3,
                            presence_penalty=-0.2, repetition_penalty=1.1),
             SamplingParams(temperature=1.3, top_k=vocab - 1, top_logprobs_num=3)]
    specs = [RowSpec(params=p, seed=7 * i, sample_index=i, position=i, output_ids=(1,),
                     prompt_ids=(2,)) for i, p in enumerate(cases)]
    sb = build_sampling_batch(specs, 8, vocab)
    for i, p in enumerate(cases):
        greedy = p.temperature == 0.0 or p.top_k == 1
        want = {"temperature": 0.0 if greedy else p.temperature,
                "top_k": 0 if greedy or not 0 < p.top_k < vocab else p.top_k,
                "top_p": 1.0 if greedy else p.top_p, "min_p": 0.0 if greedy else p.min_p,
                "frequency_penalty": p.frequency_penalty,
                "presence_penalty": p.presence_penalty,
                "repetition_penalty": p.repetition_penalty,
                "top_logprobs_num": p.top_logprobs_num}
        for name, value in want.items():
            stored = np.asarray(getattr(sb, name))
            one = np.zeros(1, stored.dtype)
            one[0] = value  # the element store the kept fields must match bit for bit
            assert stored[i].tobytes() == one[0].tobytes(), (i, name, stored[i], value)
    assert bool(sb.any_penalty) and bool(sb.any_logprobs) and bool(sb.any_filter)
    kept = cases[2].sampler_fields
    assert cases[2].sampler_fields is kept  # computed once for this params object
    changed = cases[2].with_updates(temperature=0.0)
    assert changed.sampler_fields.floats[0] == 0.0 and kept.floats[0] == 0.1


def test_a_kept_plain_decode_steps_sampler_inputs_equal_a_rebuild() -> None:
    """SteadyRows reuses a plain decode step's SamplingBatch for the next plain steps of
    the same samples: every reuse equals, field for field and bit for bit, what
    step_rows + build_sampling_batch build for that step, including a sample whose
    min_new_tokens bans end part-way, rows that change when a request joins or ends,
    and a penalised sample that keeps its step from being kept at all."""
    sim = Sim(num_pages=64, max_tokens=64, max_rows=8)
    rules = StopRules(frozenset([2]), 256, None)
    vocab, rows_padded = 128, 8
    zeros, no_masks = penalty_zeros(rows_padded, vocab), mask_zeros(rows_padded, vocab)

    def zeros_for(num_rows: int) -> tuple[Any, Any, Any]:
        assert num_rows == rows_padded
        return zeros.output_counts, zeros.prompt_mask, no_masks

    def req(rid: str, n: int, **params: Any) -> Req:
        params.setdefault("ignore_eos", True)
        return Req(rid, 0, list(range(3, 3 + n)),
                   SamplingParams(max_new_tokens=params.pop("max_new", 12), **params),
                   7 + n, lambda _: None)

    sim.add(req("greedy", 5, temperature=0.0),
            req("sampled", 6, temperature=0.8, top_k=7, top_p=0.9, top_logprobs_num=2),
            req("banned", 7, min_new_tokens=4, stop_token_ids=(9,), max_new=9))
    steady, reused, kept_penalised, reused_banned = SteadyRows(), 0, False, False
    for step in range(30):
        if step == 6:
            sim.add(req("late", 4, temperature=0.5))
        if step == 16:
            sim.add(req("penalised", 3, frequency_penalty=0.5, max_new=4))
        batch = sim.sched.schedule()
        if batch is None:
            break
        specs, wants_lp = step_rows(batch, rules, mask_words(vocab))
        fresh = build_sampling_batch(specs, rows_padded, vocab, zeros=zeros,
                                     no_masks=no_masks)
        got = steady.reuse(batch, rows_padded, zeros_for)
        if got is None:
            steady.keep(batch, rows_padded, specs, fresh, wants_lp)
            kept_penalised |= steady._small is not None and any(
                r.req.params.has_penalty for r in batch.rows)
        else:
            reused += 1
            reused_banned |= any(r.req.rid == "banned" for r in batch.rows)
            assert got[1] == wants_lp
            for f in dataclasses.fields(SamplingBatch):
                a, b = np.asarray(getattr(got[0], f.name)), np.asarray(getattr(fresh, f.name))
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (step, f.name)
        sim.sched.launch(batch)
        for row in batch.rows:  # the model-free read of Sim.step
            if row.samples:
                row.req.pending -= 1
                row.req.output_ids.append(10 + len(row.req.output_ids))
                if len(row.req.output_ids) >= row.req.params.max_new_tokens:
                    sim.finish(row.req)
    assert reused >= 5 and reused_banned and not kept_penalised
