"""A tiny random Llama in Hugging Face format, for fast reliability runs on CPU.

Owns `TINY_RELIABILITY_MODEL` (2 layers, hidden 64, the default tokenizer's full
vocabulary, so chat templates and any text tokenize to ids the model accepts),
`write_tiny_model(dir, seed, perturb)` and `tiny_engine_fields()`: EngineConfig fields
with one small shape bucket, so a fleet of these warms up in seconds.

Invariants: the same (seed, perturb) always writes the same weights; a perturbed
checkpoint has the base checkpoint's exact tensor names and shapes (a valid weight
update for an engine serving the base), but different greedy outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ModelConfig

TOKENIZER_VOCAB = 49152  # SmolLM2's tokenizer (the default model's)
TINY_RELIABILITY_MODEL = ModelConfig(
    architecture="llama", vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def tiny_params(cfg: ModelConfig, seed: int, perturb: float = 0.0) -> dict[str, Any]:
    """Unit-variance embeddings and 1/sqrt(fan_in) projections (varied greedy output);
    `perturb` > 0 multiplies every weight by (1 + perturb * N(0, 1)), from another stream."""
    from multiserve.model.loading.param_layout import param_shapes

    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1_000_003)

    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name:
            x = np.ones(shape, np.float32)
        elif name == "embed":
            x = rng.standard_normal(shape).astype(np.float32)
        else:
            x = (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
        if perturb:
            x = x * (1.0 + perturb * noise.standard_normal(shape)).astype(np.float32)
        return x

    shapes = param_shapes(cfg)
    return {k: ({n: init(n, s) for n, s in v.items()} if k == "layers" else init(k, v))
            for k, v in shapes.items()}


def write_tiny_model(path: Path | str, seed: int = 0, perturb: float = 0.0) -> Path:
    """Write the tiny model (with the default model's tokenizer) to `path`; returns it."""
    from multiserve.model.loading.default_model import default_tokenizer_dir
    from multiserve.model.loading.hf import save_hf_dir

    return save_hf_dir(Path(path), TINY_RELIABILITY_MODEL,
                       tiny_params(TINY_RELIABILITY_MODEL, seed, perturb),
                       tokenizer_dir=default_tokenizer_dir())


def tiny_engine_fields(**overrides: Any) -> dict[str, Any]:
    """EngineConfig fields for a tiny-model engine: one 64-token x 64-row bucket, a 4096-
    token KV pool, 256-token contexts (every generation is short)."""
    fields: dict[str, Any] = dict(
        precompile_token_paddings=(64,), precompile_bs_paddings=(64,), max_running_requests=64,
        chunked_prefill_size=64, page_size=16, max_total_tokens=4096, max_context_len=256,
        show_progress=False)
    fields.update(overrides)
    return fields


def tiny_fleet_config(model_dir: Path | str, engines: int = 4, *, api_key: str | None = None,
                      front_door: bool = True, **engine_overrides: Any) -> Any:
    """A FleetConfig of `engines` tiny engines, one CPU device each, with the front door
    (unless `front_door` is false), every port ephemeral on 127.0.0.1 (loopback only)."""
    from multiserve.config import EngineConfig, FleetConfig, ServerConfig

    fields = tiny_engine_fields(**engine_overrides)
    return FleetConfig(
        engines=tuple(EngineConfig(model_path=str(model_dir), device_indexes=(i,), **fields)
                      for i in range(engines)),
        servers=tuple(ServerConfig(host="127.0.0.1", port=0) for _ in range(engines)),
        supervisor=ServerConfig(host="127.0.0.1", port=0), platform="cpu", api_key=api_key,
        front_door=ServerConfig(host="127.0.0.1", port=0) if front_door else None)
