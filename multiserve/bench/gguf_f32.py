"""The llama.cpp peer's model: an F32 (or BF16) copy of a GGUF file.

The engine de-quantizes a quantized GGUF once and computes in float32, so the fair
llama.cpp figure is llama.cpp on the same de-quantized weights in F32, not on the
quantized file (which reads 6-8x fewer weight bytes per token). `f32_copy(src)` writes
that copy: every metadata key of `src` unchanged except `general.file_type`, every tensor
de-quantized with the `gguf` package's reference de-quantizers (already F32 ones copied).

A BF16 engine is compared with llama.cpp on a BF16 copy (`dtype_copy(src, "BF16")`): the
matrices de-quantized then rounded to bfloat16 (round to nearest even, the gguf package's
BF16 quantizer, as llama.cpp's MOSTLY_BF16 writes them), 1-D tensors (norms) kept F32 as
llama.cpp's own converter keeps them; the engine's bfloat16 load rounds the same way.

Cached next to the engine's own GGUF conversions (`model_cache.cache_root()`), named by the
source's name, size and mtime: a changed source gets a new copy; deleting it is safe.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Keys the writer owns (counts, version) or that this copy changes (file type).
_WRITER_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count",
                          "general.architecture", "general.file_type"})


KINDS = ("F32", "BF16")


def f32_path(src: Path, kind: str = "F32") -> Path:
    """Where the F32 (BF16) copy of `src` lives (whether or not it is written yet)."""
    from multiserve.model.loading.model_cache import cache_root

    st = src.stat()
    return (cache_root() / "f32-gguf" /
            f"{src.stem}.{st.st_size}-{st.st_mtime_ns}.{kind}.gguf")


def f32_copy(src: Path | str) -> Path:
    """The F32 copy of GGUF `src`, written on first use (atomically: a crash leaves none)."""
    return dtype_copy(src, "F32")


def dtype_copy(src: Path | str, kind: str) -> Path:
    """The `kind` (KINDS) copy of GGUF `src`, written on first use (atomically)."""
    assert kind in KINDS, kind
    src = Path(src)
    out = f32_path(src, kind)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_copy(src, tmp, kind)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_copy(src: Path, dst: Path, kind: str) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key in _WRITER_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    bf16 = kind == "BF16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if bf16 and values.ndim > 1:
            qtype = gguf.GGMLQuantizationType.BF16
            # the quantized array's own (byte) shape: the writer derives the element shape
            writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
