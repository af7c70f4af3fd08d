"""One compile per step program per process (engine/device/program_share.py).

What is checked: an engine on another device, with the same model and buckets as an
engine that already compiled its programs, warms up without one persistent-cache miss
(every program is loaded, none compiled), and its outputs (ids and logprobs, greedy and
seeded, alone and batched) are bitwise the first engine's; the loaded programs run on its
own device."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import pytest

from multiserve.engine.commands import Call
from multiserve.types import SamplingParams

DEVICE = 3  # not the shared tiny engine's device


def _outputs(engine: Any) -> list[tuple[Any, Any]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                            return_logprob=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, ignore_eos=True,
                            return_logprob=True, seed=11)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8] * 7]
    alone = [engine.generate(input_ids=p, sampling_params=greedy) for p in prompts]
    together = engine.generate(input_ids=prompts, sampling_params=[greedy, seeded])
    return [(o.output_ids, o.logprobs) for o in (*alone, *together)]


def test_a_second_device_loads_every_program_and_matches_bitwise(tiny_engine: Any) -> None:
    from jax import monitoring

    from multiserve.engine.engine import Engine

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off")
    assert tiny_engine.wait_compiled(600)
    events: Counter[str] = Counter()

    def count(name: str, **_: Any) -> None:
        events.update([name])

    monitoring.register_event_listener(count)
    other = Engine(tiny_engine.config.with_updates(device_indexes=(DEVICE,)))
    try:
        assert other.wait_compiled(600)
        warm = dict(events)
        assert warm.get("/jax/compilation_cache/cache_misses", 0) == 0, warm
        assert warm.get("/jax/compilation_cache/cache_hits", 0) >= 2, warm
        params, kv = other.call(Call(lambda c: (c.runner.params, c.runner.kv))).result()
        assert all(x.devices() == {jax.devices()[DEVICE]}
                   for x in jax.tree.leaves((params, kv)))
        assert _outputs(other) == _outputs(tiny_engine)
    finally:
        other.shutdown()
        monitoring.unregister_event_listener(count)
