"""A tiny random Llama saved as an HF dir with the default model's tokenizer (so the
benchmark's chat-templated prompts fit its vocabulary): fast engines for bench tests."""

from __future__ import annotations

from pathlib import Path

TINY = dict(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,))

# Small buckets and KV pool: the engine compiles in seconds.
ENGINE_FLAGS = ["--token-paddings", "64", "256", "--bs-paddings", "64",
                "--max-total-tokens", "8192", "--no-progress"]


def save_tiny_model(path: Path) -> Path:
    from multiserve.config import ModelConfig
    from multiserve.model.loading.default_model import default_tokenizer_dir
    from multiserve.model.testing import init_random_params, save_hf_dir

    cfg = ModelConfig(**TINY)
    return save_hf_dir(path, cfg, init_random_params(cfg, seed=5, scale=0.3),
                       tokenizer_dir=default_tokenizer_dir())
