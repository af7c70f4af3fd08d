"""Replacing a loaded LoRA adapter in place (sglang's load_inplace, prime-rl's reload
after each training step): requests admitted before the reload, running or queued, finish
on the version they were admitted with, bit for bit; requests admitted after it get the
new version; the old version's slot is taken again once its last request is done; with
every slot held the reload is refused "full" and nothing changes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_ENGINE
from lora_checkpoints import loaded, peft_tensors, refused

from multiserve.types import GenerateRequest, OutputDelta, SamplingParams

PROMPT = (5, 9, 13, 17, 21, 4, 8)
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                        return_logprob=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **TINY_ENGINE,
                              max_loras_per_batch=2, max_lora_rank=4))
    try:
        yield eng
    finally:
        eng.shutdown()


def _alone(engine: Any, name: str) -> tuple[Any, ...]:
    out = engine.generate(input_ids=list(PROMPT), sampling_params=PARAMS, lora_name=name)
    return tuple(out.output_ids), tuple(t.logprob for t in out.logprobs)


class _Held:
    """One request submitted now (its bits collected from its deltas)."""

    def __init__(self, engine: Any, rid: str, name: str) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.done = threading.Event()
        engine.submit(GenerateRequest(rid=rid, input_ids=PROMPT, sampling=PARAMS,
                                      lora_name=name), self._sink)

    def _sink(self, out: OutputDelta) -> None:
        self.ids.extend(out.new_ids)
        self.logprobs.extend(t.logprob for t in out.new_logprobs or ())
        if out.finished:
            self.done.set()

    def bits(self) -> tuple[Any, ...]:
        assert self.done.wait(120)
        return tuple(self.ids), tuple(self.logprobs)


def test_load_inplace_keeps_admitted_requests_on_their_version(engine: Any) -> None:
    cfg = engine.model_config
    v1, v2, v3 = (peft_tensors(cfg, 4, seed) for seed in (21, 22, 23))
    assert loaded(engine.load_lora_adapter("v", tensors=v1, r=4))["slot"] == 1
    old = _alone(engine, "v")
    engine.pause_generation("in_place")
    try:
        first = _Held(engine, "on-v1", "v")  # admitted, queued: version 1
        res = loaded(engine.load_lora_adapter("v", tensors=v2, r=4, load_inplace=True))
        assert res["replaced"] and res["slot"] == 2  # slot 1 stays with its request
        second = _Held(engine, "on-v2", "v")  # version 2
        # slot 1 held by `first`, 2 by `second`
        refused(engine.load_lora_adapter("v", tensors=v3, r=4, load_inplace=True), "full",
                "replaced version")
        refused(engine.load_lora_adapter("v", tensors=v3, r=4), "exists",  # no load_inplace
                "already loaded")
    finally:
        engine.continue_generation()
    assert first.bits() == old
    new = _alone(engine, "v")
    assert second.bits() == new and new != old
    # nobody uses version 2 now: version 3 goes into its slot; slot 1 is free again
    res = loaded(engine.load_lora_adapter("v", tensors=v3, r=4, load_inplace=True))
    assert res["replaced"] and res["slot"] == 2
    assert _alone(engine, "v") not in (old, new)
    assert loaded(engine.load_lora_adapter("w", tensors=v1, r=4))["slot"] == 1
    assert _alone(engine, "w") == old  # version 1's tensors under another name: its bits
    # load_inplace of a name not loaded is a plain load (refused here: no slot is free)
    refused(engine.load_lora_adapter("x", tensors=v1, r=4, load_inplace=True), "full")
    for name in ("v", "w"):
        loaded(engine.unload_lora_adapter(name))
