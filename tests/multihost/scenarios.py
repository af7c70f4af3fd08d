"""What the leader of a test slice (or the one-process reference) does with its engine;
each scenario returns plain JSON data to compare across runs."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from multiserve.config import EngineConfig
from multiserve.types import SamplingParams

PROMPTS = [[1, 5, 9, 200, 7, 33, 4000, 12], [1, 17, 23], [1, 99, 98, 97, 96, 95, 94, 93, 92,
                                                           91, 90, 11, 300]]


def _out(o: Any) -> dict[str, Any]:
    return {"ids": list(o.output_ids), "finish": str(o.finish_reason), "error": o.error,
            "logprobs": None if o.logprobs is None else
            [float(t.logprob).hex() for t in o.logprobs]}


def _prompts() -> list[list[int]]:
    """PROMPTS, each id modulo $NODE_VOCAB where the checkpoint's vocabulary is smaller
    (the family checkpoints' 512 ids)."""
    vocab = int(os.environ.get("NODE_VOCAB", "0"))
    return [[t % vocab for t in p] for p in PROMPTS] if vocab else PROMPTS


def bits(engine: Any) -> dict[str, Any]:
    """Greedy and seeded samples of three prompts, batched, then the first alone."""
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                            return_logprob=True)
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True, return_logprob=True)
    prompts = _prompts()
    batch = engine.generate(input_ids=prompts + prompts,
                            sampling_params=[greedy] * 3 + [seeded] * 3)
    alone = engine.generate(input_ids=prompts[0], sampling_params=greedy)
    return {"batch": [_out(o) for o in batch], "alone": _out(alone)}


def _submit(engine: Any, rid: str, ids: list[int], params: SamplingParams) -> Any:
    """Submit without waiting; the returned queue gets the request's deltas."""
    import queue

    from multiserve.types import GenerateRequest

    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    engine.submit(GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=params,
                                  stream=True), q.put)
    return q


def _final(q: Any) -> dict[str, Any]:
    from multiserve.engine.streams import OutputAssembler

    assemble = OutputAssembler()
    while True:
        out = assemble(q.get(timeout=120))
        if out.finished:
            return {**_out(out), "versions": sorted({seg.weight_version
                                                     for seg in out.weight_segments})}


def controls(engine: Any, perturbed_dir: str) -> dict[str, Any]:
    """Pause (retract) and continue under traffic, an abort and a resubmit, a flush, then
    a weight update from disk with requests paused mid-generation, and a fresh request
    on the new weights. What is returned does not depend on when a control landed."""
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                            return_logprob=True)
    res: dict[str, Any] = {}
    qs = [_submit(engine, f"p{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    res["pause"] = engine.pause_generation(mode="retract").ok
    res["continue"] = engine.continue_generation().ok
    res["paused_then_continued"] = [_final(q) for q in qs]
    q = _submit(engine, "gone", PROMPTS[1], greedy)
    engine.abort_request("gone")
    res["aborted_finish"] = _final(q)["finish"]
    res["resubmitted"] = _final(_submit(engine, "gone", PROMPTS[1], greedy))
    res["flush"] = engine.flush_cache().ok
    qs = [_submit(engine, f"w{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    res["pause_for_update"] = engine.pause_generation(mode="in_place").ok
    update = engine.update_weights_from_disk(perturbed_dir, weight_version="v2")
    res["update"] = (update.ok, update.message)
    res["continue_after_update"] = engine.continue_generation().ok
    res["mid_update"] = [{k: v for k, v in _final(q).items()
                          if k in ("error", "finish", "versions")} for q in qs]
    res["after_update"] = _final(_submit(engine, "new", PROMPTS[0], greedy))
    return res


FLOAT = re.compile(r"\b(f16|bf16|f32|f64)\[")


def collectives(engine: Any) -> dict[str, Any]:
    """How many compiled step programs the engine holds, and the cross-device collectives
    in their optimized HLO: all-gathers (bits moved, none added), all-reduces (sums across
    devices), and of those the float ones with the JAX operations they come from (a gather
    from a table split over the devices is one: each device's rows, zeros elsewhere)."""
    from multiserve.engine.device.step_programs import HeadProgram

    programs = engine._core.runner.step_programs  # noqa: SLF001 - the compiled programs
    texts = []
    for kind, size in programs.buckets():
        program = programs.set.get(kind, size)
        if program is None:  # not compiled (yet)
            continue
        parts = ([program.logits, program.sampler] if isinstance(program, HeadProgram)
                 else [program])
        texts += [p.as_text() for p in parts]
    lines = [line for t in texts for line in t.splitlines()]

    def of(kind: str) -> list[str]:
        return [line for line in lines if re.search(rf" {kind}(-start)?\(", line)]

    floats = [line for line in of("all-reduce")
              if FLOAT.search(line.split(" all-reduce")[0].split("=", 1)[1])]
    sources = sorted({m.group(1) for line in floats
                      for m in re.finditer(r'op_name="[^"]*/(\w+)"', line)})
    return {"programs": len(texts), "all-gather": len(of("all-gather")),
            "all-reduce": len(of("all-reduce")), "reduce-scatter": len(of("reduce-scatter")),
            "float all-reduce": len(floats), "float all-reduce sources": sources}


def run(name: str, cfg: EngineConfig, model_dir: str, perturbed_dir: str | None = None
        ) -> dict[str, Any]:
    from multiserve.engine.engine import Engine

    engine = Engine(cfg)
    try:
        plan_out = os.environ.get("NODE_PLAN_OUT")
        if plan_out:  # the calibrated plan, for the runs compared with this one to pin
            with open(plan_out, "w") as f:
                json.dump(engine._core.runner.plan.to_json(), f)
        out = bits(engine)
        out["collectives"] = collectives(engine)
        out["plan_verified"] = engine._core.runner.plan.verified  # noqa: SLF001
        if name == "all":
            assert perturbed_dir is not None
            out["controls"] = controls(engine, perturbed_dir)
        return out
    finally:
        engine.shutdown()
