"""`load_model`: one entry point for every model source (jax-free; params stay on the host).

- None: the embedded default model (`default_model.default_model_path()`).
- a directory: a Hugging Face model dir (`hf`: hf.py).
- a `.gguf` file: converted once into the cache (`model_cache`), then loaded as an HF dir.
Every failure is a ModelLoadError (a ValueError) naming the file and, if any, the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.loading.hf import load_hf_dir, save_hf_dir  # noqa: F401 (re-export)
from multiserve.model.loading.param_layout import init_random_params  # noqa: F401 (re-export)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # numpy pytree on the host (layout: param_layout)
    tokenizer_dir: Path  # directory AutoTokenizer.from_pretrained can load
    path: Path  # the HF-format directory the weights came from


def numpy_dtype(dtype: Any) -> np.dtype:
    """np.dtype for "float32"/"bfloat16"/"float16" names or dtype-likes (bfloat16 via
    ml_dtypes)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}") from e


def resolve_model_dir(path: str | Path | None) -> Path:
    """The HF-format directory for a model source (converting a GGUF if needed)."""
    if path is None:
        from multiserve.model.loading.default_model import default_model_path

        return default_model_path()
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.is_file() and p.suffix == ".gguf":
        from multiserve.model.loading.model_cache import cached_gguf_dir

        return cached_gguf_dir(p)
    if p.is_file():
        raise ModelLoadError(f"{p}: not a model directory or a .gguf file")
    raise ModelLoadError(f"{p}: model path not found")


def load_model(path: str | Path | None, dtype: Any = "float32") -> LoadedModel:
    """Load config, params (numpy, `dtype`) and the tokenizer location of a model."""
    model_dir = resolve_model_dir(path)
    cfg, params = load_hf_dir(model_dir, numpy_dtype(dtype))
    return LoadedModel(config=cfg, params=params, tokenizer_dir=model_dir, path=model_dir)
