"""multiserve/host/populated.py: a populated buffer behaves as np.empty's (shape, dtype, C
order, writable, its memory freed with it), large or small; a large one is resident when
made (Linux); and the model loader's stacked weights are the np.stack they replace, bit
for bit."""

from __future__ import annotations

import gc
import mmap
import sys

import ml_dtypes
import numpy as np
import pytest

from multiserve.host.populated import MIN_BYTES, populated_empty


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
@pytest.mark.parametrize("shape", [(3, 5), (4, 1024, 1024)])
def test_an_array_of_the_shape_and_dtype_asked_writable_and_c_ordered(shape, dtype) -> None:
    a = populated_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    a[...] = np.arange(a.size).reshape(shape).astype(dtype)
    assert np.array_equal(a, np.arange(a.size).reshape(shape).astype(dtype))


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
                    reason="MAP_POPULATE is Linux's: elsewhere populated_empty is np.empty")
def test_a_large_buffer_is_resident_when_made_and_freed_with_its_last_view() -> None:
    size = 64 << 20
    gc.collect()
    before = _resident_bytes()
    a = populated_empty((size,), np.uint8)
    assert _resident_bytes() - before >= size * 0.9  # nothing written yet
    view = a[10:20]
    view[:] = 7
    del a
    gc.collect()
    assert _resident_bytes() - before >= size * 0.9  # a view still holds the buffer
    del view
    gc.collect()
    assert _resident_bytes() - before < size * 0.5


def test_a_small_buffer_is_not_mapped_on_its_own() -> None:
    gc.collect()
    before = _resident_bytes()
    a = populated_empty((MIN_BYTES // 2,), np.uint8)  # malloc's: not resident until written
    assert a.nbytes < MIN_BYTES and _resident_bytes() - before < MIN_BYTES // 2


def test_stacked_weights_are_the_np_stack_they_replace() -> None:
    from multiserve.model.loading.hf_names import _stack

    rng = np.random.default_rng(0)
    layers = {(i,): rng.standard_normal((256, 1024)).astype(np.float32).T for i in range(4)}
    got = _stack(layers)
    assert got.flags.c_contiguous
    assert np.array_equal(got, np.stack([layers[(i,)] for i in range(4)]))
    experts = {(i, e): rng.standard_normal((64, 512)).astype(ml_dtypes.bfloat16)
               for i in range(3) for e in range(5)}
    want = np.stack([np.stack([experts[(i, e)] for e in range(5)]) for i in range(3)])
    assert np.array_equal(_stack(experts).view(np.uint16), want.view(np.uint16))
