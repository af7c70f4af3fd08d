"""The host inputs of a step's programs, as the programs take them.

A program's small host inputs travel as ONE packed int32 array (packed.py): the
step arrays of a forward (`step_inputs`), the SamplingBatch fields of a head except its
two [R, V] penalty arrays and its [R, V/32] token mask (`sampling_inputs`), which are
passed as arrays of their own (host arrays, or the engine's cached device zeros:
sampling_zeros.py).

They are handed to the program's call as NumPy arrays: the compiled call moves them to the
device with its input sharding (replicated) in its own C++ path. A Python
`jax.device_put` first costs the same transfer plus ~0.5 ms of host time at one decode
row, taken from the cores the step runs on (docs/performance.md §1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.step_inputs.packed import pack
from multiserve.engine.step_inputs.token_arrays import StepArrays

# the step arrays a forward reads, in its packed order
ARRAY_FIELDS = ("input_ids", "from_prev", "positions", "token_seq", "out_slots", "page_table",
                "seq_lens", "logit_rows")


def step_tree(arrays: StepArrays) -> dict[str, np.ndarray]:
    """The step arrays a forward program reads, by name; `lora_slots` only in an engine
    with LoRA (without it the tree, so the packed layout, is exactly ARRAY_FIELDS')."""
    tree = {k: getattr(arrays, k) for k in ARRAY_FIELDS}
    if arrays.lora_slots is not None:
        tree["lora_slots"] = arrays.lora_slots
    return tree


def step_inputs(arrays: StepArrays) -> np.ndarray:
    """A forward program's step arrays: one packed int32 host array."""
    return pack(step_tree(arrays))


def small_sampling_fields(sb: sampling.SamplingBatch) -> sampling.SamplingBatch:
    """`sb` without its [R, V] (and [R, V/32]) arrays (None: no leaves), the part a head
    program gets packed."""
    return dataclasses.replace(sb, output_counts=None, prompt_mask=None, token_mask=None)


def sampling_inputs(sb_host: sampling.SamplingBatch) -> tuple[np.ndarray, Any, Any, Any]:
    """A head program's sampling inputs: the small fields packed into one int32 host
    array, then output_counts, prompt_mask and token_mask (host arrays, or the engine's
    cached device zeros while no row has a penalty / a grammar)."""
    return (pack(small_sampling_fields(sb_host)), sb_host.output_counts,
            sb_host.prompt_mask, sb_host.token_mask)
