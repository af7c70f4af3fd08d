"""The llama.cpp peer's model: an F32 copy of a GGUF file.

The engine de-quantizes a quantized GGUF once and computes in float32, so the fair
llama.cpp figure is llama.cpp on the same de-quantized weights in F32, not on the
quantized file (which reads 6-8x fewer weight bytes per token). `f32_copy(src)` writes
that copy: every metadata key of `src` unchanged except `general.file_type`, every tensor
de-quantized with the `gguf` package's reference de-quantizers (already F32 ones copied).

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


def f32_path(src: Path) -> Path:
    """Where the F32 copy of `src` lives (whether or not it is written yet)."""
    from multiserve.model.loading.model_cache import cache_root

    st = src.stat()
    return cache_root() / "f32-gguf" / f"{src.stem}.{st.st_size}-{st.st_mtime_ns}.F32.gguf"


def f32_copy(src: Path | str) -> Path:
    """The F32 copy of GGUF `src`, written on first use (atomically: a crash leaves none)."""
    src = Path(src)
    out = f32_path(src)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_f32(src, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_f32(src: Path, dst: Path) -> None:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key in _WRITER_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(
            dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
