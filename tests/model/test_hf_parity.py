"""Logits parity with Hugging Face transformers (torch fp32, same weights) for tiny random
Llama / Llama-with-llama3-rope-scaling / tied Llama (SmolLM2-like) / Qwen2 / Qwen3 configs:
weights saved as safetensors dirs by transformers, loaded through OUR loader, run as a
ragged batch mixing prefills, chunked prefills and decode steps through the paged pool."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from model_helpers import PagedSim

from multiserve.config import ModelConfig, RopeScaling
from multiserve.model.loading.hf import rope_scaling_to_hf
from multiserve.model.loading.hf_names import params_to_hf
from multiserve.model.loading.loader import load_model
from multiserve.model.loading.param_layout import init_random_params

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,))
CONFIGS = {
    "llama": ModelConfig(architecture="llama", rope_theta=10000.0, **BASE),
    "llama3_rope": ModelConfig(
        architecture="llama", rope_theta=500000.0, max_position_embeddings=4096,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16), **BASE),
    "llama_tied": ModelConfig(architecture="llama", rope_theta=100000.0,
                              tie_word_embeddings=True,
                              **{**BASE, "num_heads": 6, "hidden_size": 96, "num_kv_heads": 2}),
    "qwen2": ModelConfig(architecture="qwen2", rope_theta=1e6, attention_bias=True,
                         tie_word_embeddings=True, **BASE),
    "qwen3": ModelConfig(architecture="qwen3", rope_theta=1e6, qk_norm=True,
                         **{**BASE, "head_dim": 32}),
}
torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}


def make_hf_model(cfg: ModelConfig, seed: int) -> transformers.PreTrainedModel:
    """A transformers model of `cfg` holding our random weights (scaled for O(1) logits)."""
    conf_cls, model_cls = HF_CLASSES[cfg.architecture]
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              max_position_embeddings=cfg.max_position_embeddings,
              tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
              eos_token_id=cfg.eos_token_ids[0])
    if cfg.rope_scaling is not None:
        kw["rope_scaling"] = rope_scaling_to_hf(cfg.rope_scaling)
    hf_conf = conf_cls(**kw)
    hf_conf.architectures = [model_cls.__name__]
    model = model_cls(hf_conf).eval()
    params = init_random_params(cfg, seed=seed, scale=0.3)
    state = {k: torch.from_numpy(v.copy()) for k, v in params_to_hf(params, cfg).items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


_PAIRS: dict[str, tuple[ModelConfig, transformers.PreTrainedModel, Path]] = {}


def hf_pair(name: str, factory: pytest.TempPathFactory):
    """(config, transformers model, its save_pretrained dir), built once per config."""
    if name not in _PAIRS:
        cfg = CONFIGS[name]
        model = make_hf_model(cfg, seed=len(name))
        path = factory.mktemp(f"hf-{name}")
        model.save_pretrained(path, safe_serialization=True)
        _PAIRS[name] = (cfg, model, path)
    return _PAIRS[name]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loader_reads_config(name: str, tmp_path_factory) -> None:
    cfg, _, path = hf_pair(name, tmp_path_factory)
    assert load_model(str(path), "float32").config == cfg


# (page_size, attn_block_size): block a multiple of the page, equal, and (llama) a divisor
CASES = [(name, ps, bs) for name in sorted(CONFIGS) for ps, bs in ((1, 4), (4, 8), (16, 16))]
CASES.append(("llama", 16, 8))


@pytest.mark.parametrize("name,page_size,block", CASES)
def test_ragged_paged_batches_match_transformers(name: str, page_size: int, block: int,
                                                 tmp_path_factory) -> None:
    cfg, model, path = hf_pair(name, tmp_path_factory)
    loaded = load_model(str(path), "float32")
    rng = np.random.default_rng(page_size)
    lens = {"a": 37, "b": 9, "c": 26}
    toks = {k: [int(t) for t in rng.integers(3, cfg.vocab_size, n)] for k, n in lens.items()}
    with torch.no_grad():
        ref = {k: model(torch.tensor([v])).logits[0].numpy() for k, v in toks.items()}
    sim = PagedSim(jax.device_put(loaded.params), cfg, page_size=page_size, block_size=block)
    for k, v in toks.items():
        sim.add(k, v)
    everything = {k: list(range(n)) for k, n in lens.items()}
    got: dict = {}
    # prefill a (most of it) + b; then c in chunks while a and b decode; then decode all
    schedule = [[("a", 30), ("b", 6)], [("a", 1), ("b", 1), ("c", 11)],
                [("a", 1), ("c", 13), ("b", 1)], [("c", 1), ("b", 1), ("a", 1)],
                [("a", 1), ("c", 1)], [("a", 1), ("a", 0)], [("a", 1), ("a", 0)],
                [("a", 1)]]
    for i, work in enumerate(schedule):
        got.update(sim.step([w for w in work if w[1]], T=64, B=64, R=64,
                            rows=np.random.default_rng(i), logits_for=everything))
    assert set(got) == {(k, p) for k, n in lens.items() for p in range(n)}
    diff = max(float(np.max(np.abs(got[(k, p)] - ref[k][p]))) for k, p in got)
    scale = max(float(np.max(np.abs(r))) for r in ref.values())
    print(f"{cfg.architecture} ps={page_size} bs={block}: max|diff|={diff:.2e} "
          f"(max|logit|={scale:.2f})")
    assert scale > 1.0  # the logits are not trivially small
    assert diff <= 1e-3
