"""step_inputs.packed: a program's small host inputs travel as one int32 array, bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from multiserve.engine.step_inputs.packed import layout_of, pack, unpack
from multiserve.engine.step_inputs.sampling_batch import RowSpec, build_sampling_batch
from multiserve.types import SamplingParams


def _roundtrip(tree):  # noqa: ANN001, ANN202
    layout = layout_of(tree)
    flat = pack(tree)
    assert flat.dtype == np.int32 and flat.shape == (layout.size,)
    return jax.jit(unpack, static_argnums=1)(jax.numpy.asarray(flat), layout)


def test_every_32_bit_value_and_bool_comes_back_bit_for_bit() -> None:
    floats = np.array([0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, 1e-45, -3.4e38], np.float32)
    tree = {"f": floats.reshape(2, 4), "u": np.array([0, 1, 2**32 - 1, 2**31], np.uint32),
            "i": np.array([-(2**31), -1, 0, 2**31 - 1], np.int32),
            "b": np.array([True, False, True]), "flag": np.bool_(True),
            "scalar": np.float32(0.25)}
    got = _roundtrip(tree)
    for name, want in tree.items():
        have = np.asarray(got[name])
        assert have.dtype == np.asarray(want).dtype and have.shape == np.shape(want), name
        assert have.tobytes() == np.asarray(want).tobytes(), name


def test_a_sampling_batch_without_its_big_arrays_round_trips() -> None:
    rows = [RowSpec(params=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3),
                    seed=2**40 + 5, sample_index=1, position=17, output_ids=(4, 4),
                    prompt_ids=(1, 2)), None]
    sb = build_sampling_batch(rows, 8, 64)
    small = sb.replace(output_counts=None, prompt_mask=None)
    got = _roundtrip(small)
    assert got.output_counts is None and got.prompt_mask is None
    for want, have in zip(jax.tree.leaves(small), jax.tree.leaves(got), strict=True):
        assert np.asarray(have).tobytes() == np.asarray(want).tobytes()
    assert float(got.temperature[0]) == pytest.approx(0.7) and int(got.seed_hi[0]) == 256


def test_other_dtypes_are_refused_not_converted() -> None:
    for leaf in (np.zeros(2, np.int64), np.zeros(2, np.float64), np.zeros(2, np.float16)):
        with pytest.raises(TypeError, match="cannot be packed"):
            pack({"x": leaf})
