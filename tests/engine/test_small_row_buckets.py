"""An engine whose largest row bucket is below the sampler's row chunk (e.g.
max_running_requests 4 < sampling.ROW_CHUNK 8): it warms up and serves, penalties
included (the head program pads the in-flight token rows to the sampler's rows; it failed
to compile with "Incompatible shapes for broadcasting: (8,), (4,)")."""

from __future__ import annotations

from pathlib import Path

from engine_helpers import TINY_ENGINE

from multiserve.config import EngineConfig
from multiserve.engine.sampling import sampler
from multiserve.types import SamplingParams


def test_row_buckets_below_the_sampler_chunk_serve_with_penalties(tiny_model_dir: Path) -> None:
    from multiserve.engine.engine import Engine

    assert sampler.ROW_CHUNK > 4
    kw = {**TINY_ENGINE, "precompile_bs_paddings": (4,), "max_running_requests": 4}
    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **kw))
    try:
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                frequency_penalty=0.7)
        prompts = [[5, 17, 42], [3, 3, 8, 9], [11, 12], [40, 41, 42, 43]]
        together = eng.generate(input_ids=prompts, sampling_params=params)
        alone = [eng.generate(input_ids=p, sampling_params=params) for p in prompts]
        assert [o.output_ids for o in together] == [o.output_ids for o in alone]
        assert all(len(o.output_ids) == 8 for o in together)
        assert eng.get_internal_state()["cache_miss_count"] == 0
    finally:
        eng.shutdown()
