"""Minimal safetensors reading/writing on numpy (incl. bfloat16 via ml_dtypes), no jax/torch.

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} (+ optional __metadata__), then the raw little-endian data. Reading memory-maps
the file, so only the tensors asked for are read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from multiserve.model.errors import ModelLoadError

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict without __metadata__)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelLoadError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read safetensors file: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return 8 + n, header


def load_file(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays (read-only memory maps)."""
    start, header = read_header(path)
    size = path.stat().st_size
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype", ""))
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype "
                                 f"{info.get('dtype')!r}")
        lo, hi = info["data_offsets"]
        shape = tuple(info["shape"])
        if start + hi > size or hi - lo != int(np.prod(shape)) * dtype.itemsize:
            raise ModelLoadError(f"{path}: tensor {name!r} data is truncated or inconsistent")
        out[name] = mm[start + lo:start + hi].view(dtype).reshape(shape)
    return out


def save_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write tensors (any dtype in _DTYPES) to `path`."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} not writable as safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
