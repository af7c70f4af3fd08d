"""Random-weight Llama-shaped models in Hugging Face format, with the default model's
tokenizer: benchmark and device-check models that need no download and no embedded GGUF.

`python -m multiserve.bench.random_model OUT --size tiny|small|1b|8b [--dtype bfloat16]`
writes config.json, model.safetensors and the tokenizer files to OUT;
`cached_random_model(size)` is that directory in the cache (`multiserve bench
--random-model SIZE`), written by its first caller.

Sizes (vocabulary: the default tokenizer's 49152 ids, so any chat-templated prompt fits):
- tiny: 2 layers, hidden 64 (the tests' tiny model; compiles in seconds);
- small: 4 layers, hidden 512 (~37M parameters; a CPU stand-in for the 1B shape);
- 1b: Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32 query and 8 KV heads of
  64, tied embeddings), ~1.07B parameters (4.3 GB in float32, 2.1 GB in bfloat16);
- 8b: Llama-3.1-8B's shape (32 layers, hidden 4096, MLP 14336, 32 query and 8 KV heads of
  128, Llama 3's vocabulary of 128256 ids, untied head, llama3 rope scaling), ~8.03B
  parameters (16.1 GB in bfloat16): the TPU compile report's large shape (`multiserve
  doctor --target tpu --compile --random-sizes 8b`); written out, its ids past the
  tokenizer's 49152 decode to nothing.
- small-<family> (mistral, gemma2, gemma3, mixtral, gpt-oss): the small shape as that
  family, a 128-token sliding window (shorter than a 64 x 128 run's sequences) on its
  window layers: Mistral's every layer; Gemma 2 alternating, soft caps 50 / 30; Gemma 3
  three window layers then a global one, q/k norms; Mixtral every layer 8 experts top-2;
  GPT-OSS alternating, sinks, biases, 8 experts top-2 of 512, YaRN.

Invariant: the same (size, seed, dtype) always writes the same weights. The weights are
N(0, 0.02^2) (norms 1 + N(0, 0.1^2)): outputs are meaningless, shapes and speed are real.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from multiserve.config import ModelConfig, RopeScaling

TOKENIZER_VOCAB = 49152  # SmolLM2's tokenizer (the default model's)
_COMMON: dict[str, Any] = dict(architecture="llama", vocab_size=TOKENIZER_VOCAB, bos_token_id=1,
               eos_token_ids=(2,), max_position_embeddings=4096)
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, tie_word_embeddings=False, **_COMMON),
    "small": ModelConfig(hidden_size=512, intermediate_size=1536, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                         **_COMMON),
    "1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
                      rope_theta=500000.0, **_COMMON),
    "8b": ModelConfig(**{**_COMMON, "vocab_size": 128256}, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, tie_word_embeddings=False, rope_theta=500000.0,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
}
_SMALL: dict[str, Any] = dict(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
              num_kv_heads=2, head_dim=64, **_COMMON)
_GEMMA: dict[str, Any] = dict(norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
              hidden_act="gelu_tanh", tie_word_embeddings=True, query_pre_attn_scalar=64.0,
              sliding_window=128)
_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_layers=(0, 1, 2, 3))
SIZES.update({
    "small-mistral": ModelConfig(**{**_SMALL, "architecture": "mistral"},
                                 sliding_window=128, sliding_layers=(0, 1, 2, 3)),
    "small-gemma2": ModelConfig(**{**_SMALL, "architecture": "gemma2"}, **_GEMMA,
                                sliding_layers=(0, 2), attn_logit_softcapping=50.0,
                                final_logit_softcapping=30.0),
    "small-gemma3": ModelConfig(**{**_SMALL, "architecture": "gemma3"}, **_GEMMA,
                                sliding_layers=(0, 1, 2), qk_norm=True,
                                rope_theta=1_000_000.0, rope_local_theta=10_000.0),
    "small-mixtral": ModelConfig(**{**_SMALL, "architecture": "mixtral",
                                    "intermediate_size": 768}, **_MOE,
                                 moe_intermediate_size=768, norm_topk_prob=True,
                                 sliding_window=128, sliding_layers=(0, 1, 2, 3)),
    # a Qwen3-MoE shape of ~1.5B parameters (0.4B active: 4 of 32 experts), as the 1B dense
    # shape is for the dense families: the MoE step's TPU compile (doctor --compile)
    "moe-1.5b": ModelConfig(**{**_COMMON, "architecture": "qwen3_moe"}, hidden_size=2048,
                            intermediate_size=6144, num_layers=16, num_heads=16,
                            num_kv_heads=4, head_dim=128, tie_word_embeddings=True,
                            qk_norm=True, rope_theta=1_000_000.0, num_experts=32,
                            num_experts_per_tok=4, moe_intermediate_size=384,
                            norm_topk_prob=True, moe_layers=tuple(range(16))),
    "small-gpt-oss": ModelConfig(**{**_SMALL, "architecture": "gpt_oss",
                                    "intermediate_size": 512}, **_MOE,
                                 moe_intermediate_size=512, sliding_window=128,
                                 sliding_layers=(0, 2), attention_bias=True, o_proj_bias=True,
                                 attention_sinks=True, norm_weight_f32=True,
                                 swiglu_limit=7.0, swiglu_alpha=1.702, rope_theta=150000.0,
                                 rope_scaling=RopeScaling(
                                     factor=32.0, rope_type="yarn", truncate=False,
                                     original_max_position_embeddings=4096,
                                     attention_factor=1.3465735902799727)),
})
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def write_random_model(path: Path | str, size: str = "tiny", seed: int = 0,
                       dtype: str = "float32") -> Path:
    """Write the `size` model with random weights (stored as `dtype`) to `path`."""
    from multiserve.model.loading.default_model import default_tokenizer_dir
    from multiserve.model.testing import init_random_params, save_hf_dir

    cfg = SIZES[size]
    params = init_random_params(cfg, seed=seed, dtype=_DTYPES[dtype], scale=0.02)
    return save_hf_dir(path, cfg, params, tokenizer_dir=default_tokenizer_dir(),
                       dtype=_DTYPES[dtype])


def cached_random_model(size: str, dtype: str = "float32", seed: int = 0) -> Path:
    """The `size` model's directory in the cache (`multiserve bench --random-model`),
    written there by the first caller (under the cache's lock; a temporary name renamed
    into place, so a reader never sees half a model)."""
    import shutil

    from multiserve.cache_files import cache_root, exclusive

    base = cache_root() / "random-models"
    path = base / f"{size}-{dtype}-seed{seed}"
    with exclusive(base / ".lock"):
        if not (path / "config.json").is_file():
            tmp = base / f".{path.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_random_model(tmp, size, seed, dtype)
            tmp.rename(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multiserve.bench.random_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    args = parser.parse_args(argv)
    print(write_random_model(args.out, args.size, args.seed, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
