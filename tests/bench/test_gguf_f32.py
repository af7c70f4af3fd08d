"""The llama.cpp peer's F32 copy of a GGUF (bench/gguf_f32.py): the same model, in F32.

What is checked: a GGUF with quantized tensors (Q8_0, Q4_1) and its F32 copy load to
bitwise the same float32 weights and the same config through the engine's own GGUF loader;
every metadata key survives (only general.file_type says F32 now); every tensor of the
copy is F32; the copy is cached by the source's identity and rewritten when it changes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from gguf_helpers import write_gguf  # noqa: E402

from multiserve.config import ModelConfig  # noqa: E402
from multiserve.model.testing import init_random_params  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture
def quantized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MULTISERVE_CACHE_DIR", str(tmp_path / "cache"))
    qtypes = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q4_1,
              "token_embd.weight": Q.Q8_0}
    return write_gguf(tmp_path / "q.gguf", CFG, init_random_params(CFG, seed=3),
                      lambda n: qtypes.get(n, Q.F32))


def test_f32_copy_is_the_same_model(quantized: Path) -> None:
    from multiserve.bench.gguf_f32 import f32_copy
    from multiserve.model.loading.gguf import read_gguf

    copy = f32_copy(quantized)
    assert copy != quantized and copy.is_file()
    src, dst = gguf.GGUFReader(str(quantized)), gguf.GGUFReader(str(copy))
    assert {t.tensor_type for t in src.tensors} == {Q.F32, Q.Q8_0, Q.Q4_1}
    assert {t.tensor_type for t in dst.tensors} == {Q.F32}
    assert dst.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    for key, field in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.file_type":
            assert dst.fields[key].contents() == field.contents(), key
    cfg_a, named_a, _ = read_gguf(quantized)
    cfg_b, named_b, _ = read_gguf(copy)
    assert cfg_a == cfg_b and named_a.keys() == named_b.keys()
    for name in named_a:
        assert np.array_equal(named_a[name], named_b[name]), name


def test_f32_copy_is_cached_by_source_identity(quantized: Path) -> None:
    from multiserve.bench.gguf_f32 import f32_copy

    first = f32_copy(quantized)
    stamp = first.stat().st_mtime_ns
    assert f32_copy(quantized) == first and first.stat().st_mtime_ns == stamp  # reused
    os.utime(quantized, ns=(stamp + 10**9, stamp + 10**9))  # the source changed
    second = f32_copy(quantized)
    assert second != first and second.is_file()


def test_bf16_copy_rounds_matrices_and_keeps_shapes(quantized: Path) -> None:
    """llama.cpp's MOSTLY_BF16 layout: matrices BF16 (each value the F32 value rounded),
    1-D tensors F32, every tensor's element shape and byte size as the header declares
    (llama.cpp refuses a file whose data offsets disagree)."""
    import ml_dtypes

    from multiserve.bench.gguf_f32 import dtype_copy
    from multiserve.model.loading.gguf import read_gguf

    copy = dtype_copy(quantized, "BF16")
    src, dst = gguf.GGUFReader(str(quantized)), gguf.GGUFReader(str(copy))
    assert dst.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_BF16
    shapes = {t.name: tuple(t.shape) for t in src.tensors}
    for t in dst.tensors:
        assert tuple(t.shape) == shapes[t.name], t.name
        assert t.tensor_type == (Q.BF16 if len(t.shape) > 1 else Q.F32), t.name
        assert t.n_bytes == t.n_elements * (2 if len(t.shape) > 1 else 4), t.name
    _, exact, _ = read_gguf(quantized)
    _, rounded, _ = read_gguf(copy)
    for name, value in exact.items():
        want = value.astype(ml_dtypes.bfloat16).astype(np.float32) if value.ndim > 1 else value
        assert np.array_equal(rounded[name], want), name
