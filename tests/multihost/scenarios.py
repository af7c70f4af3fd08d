"""What the leader of a test slice (or the one-process reference) does with its engine;
each scenario returns plain JSON data to compare across runs."""

from __future__ import annotations

from typing import Any

from multiserve.config import EngineConfig
from multiserve.types import SamplingParams

PROMPTS = [[1, 5, 9, 200, 7, 33, 4000, 12], [1, 17, 23], [1, 99, 98, 97, 96, 95, 94, 93, 92,
                                                           91, 90, 11, 300]]


def _out(o: Any) -> dict[str, Any]:
    return {"ids": list(o.output_ids), "finish": str(o.finish_reason), "error": o.error,
            "logprobs": None if o.logprobs is None else
            [float(t.logprob).hex() for t in o.logprobs]}


def bits(engine: Any) -> dict[str, Any]:
    """Greedy and seeded samples of three prompts, batched, then the first alone."""
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                            return_logprob=True)
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True, return_logprob=True)
    batch = engine.generate(input_ids=PROMPTS + PROMPTS,
                            sampling_params=[greedy] * 3 + [seeded] * 3)
    alone = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy)
    return {"batch": [_out(o) for o in batch], "alone": _out(alone)}


def run(name: str, cfg: EngineConfig, model_dir: str) -> dict[str, Any]:
    from multiserve.engine.engine import Engine

    engine = Engine(cfg)
    try:
        return {"bits": bits}[name](engine)
    finally:
        engine.shutdown()
