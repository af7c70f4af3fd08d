"""Tiny random Qwen3-MoE and Qwen2-MoE checkpoints written by transformers itself (its
config classes + `save_pretrained`, fp32), with the SmolLM2 tokenizer: shared by the
model, engine and fleet tests (tests/ is on sys.path through its conftest).

Weights are re-drawn at O(1) scale (transformers' 0.02 init makes every logit ~0 and
greedy argmax a near tie): embeddings N(0, 1), norms 1 + N(0, 0.1^2), matrices
N(0, 1 / fan_in), the router x3 so routing is decisive (no near-equal top-k scores).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

VOCAB = 512  # the tiny engine's vocabulary (engine_helpers.TINY_VOCAB): SmolLM2's first ids
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              moe_intermediate_size=32, num_experts_per_tok=2)
ARCHS: dict[str, dict[str, Any]] = {
    # 3 layers, layer 1 dense (mlp_only_layers): sparse, dense, sparse; 8 experts, top-2
    "qwen3_moe": dict(COMMON, num_hidden_layers=3, num_experts=8, norm_topk_prob=True,
                      mlp_only_layers=[1], tie_word_embeddings=False),
    # 2 layers, both sparse; 6 experts top-2 plus the shared expert (tied embeddings would
    # make a random model repeat its input token: h ~ embed[x], so logit x ~ |e_x|^2)
    "qwen2_moe": dict(COMMON, num_hidden_layers=2, num_experts=6, norm_topk_prob=False,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1,
                      tie_word_embeddings=False),
}


def hf_classes(arch: str) -> tuple[Any, Any]:
    import transformers

    return {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
            "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[arch]


def build_model(conf_cls: Any, model_cls: Any, config: dict[str, Any], seed: int
                ) -> tuple[Any, Any]:
    """(a transformers model of `config`, eval mode, its architecture named; a torch
    generator seeded with `seed` for re-drawing its weights)."""
    import torch

    conf = conf_cls(**config)
    conf.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    return model_cls(conf).eval(), torch.Generator().manual_seed(seed)


def make_model(arch: str, seed: int = 0) -> Any:
    """A transformers model of ARCHS[arch] with O(1)-scale random weights (eval mode)."""
    import torch

    model, gen = build_model(*hf_classes(arch), ARCHS[arch], seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                scale = 3.0 if name.endswith("mlp.gate.weight") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def save(model: Any, path: Path, *, sharded: bool = False) -> Path:
    """save_pretrained (fp32 safetensors; `sharded`: several files + an index) plus the
    SmolLM2 tokenizer files (an engine loads them)."""
    from multiserve.model.loading.default_model import default_model_path
    from multiserve.model.loading.hf import TOKENIZER_FILES

    kw = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    tok = default_model_path()
    for name in TOKENIZER_FILES:
        if (tok / name).exists() and name != "generation_config.json":
            shutil.copy(tok / name, path / name)
    return path


def hf_router_topk(model: Any, tokens: list[int], router: str = "gate") -> dict[int, Any]:
    """{layer index: int64 [len(tokens), k]} for every MoE layer of `model` (no entry for a
    dense one): the expert ids its transformers router picked for `tokens` (a hook on every
    `mlp.<router>`, GPT-OSS's `router`: its third output, the top-k indices, in the
    router's rank order)."""
    import torch

    got: dict[int, Any] = {}
    hooks = [getattr(layer.mlp, router).register_forward_hook(
        lambda _m, _i, out, i=i: got.__setitem__(i, out[2].reshape(len(tokens), -1).numpy()))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, router)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return got
