"""Tiny random checkpoints of the families added after Llama / Qwen, written by transformers
itself (its config classes + `save_pretrained`, fp32), with the SmolLM2 tokenizer: shared by
the model, engine and bench tests (tests/ is on sys.path through its conftest).

Every config has several layers and a sliding window far shorter than the tests' prompts
(and, where the family interleaves them, global layers beside the window layers), so both
layer kinds and pages beyond the window occur. Weights are re-drawn at O(1) scale as in
tests/moe_checkpoints.py (transformers' 0.02 init makes every logit ~0 and greedy argmax a
near tie): embeddings N(0, 1), norms 1 + N(0, 0.1^2), matrices N(0, 1 / fan_in), biases
and sinks N(0, 0.1^2) and N(0, 1), a MoE router x3 so routing is decisive. Gemma's norms are
stored as the offset from 1 (N(0, 0.1^2)); its embeddings, scaled by sqrt(hidden) in the
forward, are drawn N(0, 0.1^2) and its post-block norms scale by ~3 (offset 2 + N(0, 0.1^2)),
so the blocks' outputs, not the embedding, lead the residual stream (with tied embeddings a
random Gemma would otherwise repeat one token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_checkpoints import VOCAB, build_model, save

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
WINDOW = 12  # every family's window: shorter than the tests' prompts (20-70 tokens)
S, F = "sliding_attention", "full_attention"
ARCHS: dict[str, dict[str, Any]] = {
    # every one of its 3 layers slides: K/V more than WINDOW back is read by no layer
    "mistral": dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW,
                    rope_theta=10000.0),
    # window, global, window; scores and logits soft-capped where the random weights reach
    # the caps; a score scale that is not head_dim's; untied
    "gemma2": dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW, layer_types=[S, F, S],
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # two window layers (local rope base) then a global one (global base, linearly
    # scaled); q/k norms; tied embeddings, as every Gemma
    "gemma3": dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW, layer_types=[S, S, F],
                   query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True, rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # every layer sparse (4 experts, top-2) and sliding
    "mixtral": dict(COMMON, num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=10000.0),
    # window, full, window; attention sinks, q/k/v/o biases; 4 experts top-2 with biases
    # and a clamped SwiGLU the random weights reach; YaRN rope; the experts' input sizes a
    # multiple of MXFP4's 32-element blocks
    "gpt_oss": dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW, layer_types=[S, F, S],
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    swiglu_limit=1.5, attention_bias=True, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 256}),
}


def hf_classes(arch: str) -> tuple[Any, Any]:
    import transformers

    return {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
            "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
            "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
            }[arch]


# Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration): ARCHS["gemma3"] as its
# text model beside a one-layer SigLIP tower (28 x 28 images, 4 soft tokens an image); its
# image token is the vocabulary's last id, which the tests' prompts never hold
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, image_size=28, patch_size=14)


def make_gemma3_multimodal(seed: int = 0) -> Any:
    """A transformers Gemma3ForConditionalGeneration (GEMMA3_VISION) with the random
    weights of `make_model` (eval mode)."""
    import transformers

    conf = transformers.Gemma3Config(text_config=ARCHS["gemma3"], vision_config=GEMMA3_VISION,
                                     mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                     boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    model, gen = build_model(lambda **kw: conf, transformers.Gemma3ForConditionalGeneration,
                             {}, seed)
    return _redraw(model, gen, offset_norms=True)


def make_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of ARCHS[arch] (its fields in `overrides` replaced) with
    O(1)-scale random weights (eval mode)."""
    model, gen = build_model(*hf_classes(arch), {**ARCHS[arch], **overrides}, seed)
    return _redraw(model, gen, offset_norms=arch.startswith("gemma"))


def _redraw(model: Any, gen: Any, offset_norms: bool) -> Any:
    """The weights of `model` re-drawn (module docstring); `offset_norms`: Gemma's RMSNorm
    scales by (1 + weight)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                base = (2.0 if ".post_" in name else 0.0) if offset_norms else 1.0
                p.copy_(base + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_((0.1 if offset_norms else 1.0) * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif name.endswith("bias") or p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                scale = 3.0 if name.endswith(("mlp.gate.weight", "router.weight",
                                              "block_sparse_moe.gate.weight")) else 1.0
                p.copy_(scale * noise / p.shape[-1] ** 0.5)
    return model


def write(arch: str, path: Path, *, seed: int = 0, sharded: bool = False,
          **overrides: Any) -> Path:
    """ARCHS[arch] (`overrides` as make_model's) with random weights saved into `path` (an
    engine loads it)."""
    return save(make_model(arch, seed, **overrides), path, sharded=sharded)


def to_mxfp4(path: Path) -> Path:
    """The GPT-OSS checkpoint in `path` rewritten as the released ones are stored: every
    expert tensor as MXFP4 blocks and scales (loading/mxfp4.py `quantize`), and the config's
    `quantization_config` saying so (transformers then de-quantizes it at load)."""
    import json

    import numpy as np

    from multiserve.model.loading import mxfp4, safetensors_io

    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files  # (a single-file checkpoint)
    tensors = {k: np.array(v) for k, v in safetensors_io.load_file(files[0]).items()}
    packed: dict[str, Any] = {}
    for name, arr in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name + mxfp4.BLOCKS_SUFFIX], packed[name + mxfp4.SCALES_SUFFIX] = \
                mxfp4.quantize(arr)
        else:
            packed[name] = arr
    safetensors_io.save_file(packed, files[0])
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
