"""Read a GGUF file: its config (metadata), its tensors under HF names (de-quantized), and
its tokenizer (written as HF tokenizer files). Numpy + the `gguf` package only (no jax/torch).

llama.cpp stores llama's attn_q/attn_k rows permuted for its interleaved RoPE; we undo that
permutation so the weights match Hugging Face's rotate-half layout (qwen2/qwen3 are stored
unpermuted). Supported tensor types: SUPPORTED_TYPES; others fail naming file and tensor.

Mistral: llama.cpp converts `MistralForCausalLM` to the llama architecture; a llama GGUF
whose metadata carries `llama.attention.sliding_window` loads as Mistral with that window
on every layer (without it, as llama.cpp runs it: Llama, no window).

Mixtral: llama.cpp converts `MixtralForCausalLM` to the llama architecture too, with
`llama.expert_count` and `llama.expert_used_count` (top-k) in its metadata: such a GGUF
loads as Mixtral (softmax routing, top-k renormalised, as llama.cpp runs it). Its router is
`ffn_gate_inp`; its experts are stacked per layer (`ffn_gate_exps` [E, I, H] the experts'
w1, `ffn_up_exps` w3, `ffn_down_exps` w2), or, in files converted before llama.cpp stacked
them, one tensor each (`ffn_gate.{e}.weight`, ...): both read as the HF checkpoint's
per-expert tensors. q/k are permuted as llama's.

Gemma 3 (`gemma3`, its text model): llama.cpp names the four block norms attn_norm,
post_attention_norm, ffn_norm (the pre-feed-forward one) and post_ffw_norm, and stores
every norm weight as 1 + HF's (its RMSNorm multiplies by the weight itself): we subtract
the 1 again (exact for weights in [0.5, 2], and for any >= 0.5; a stored norm weight below
0.5 comes back rounded). What its metadata leaves out is llama.cpp's own rule for the
architecture, which we follow: every 6th layer global (unless
`gemma3.attention.sliding_window_pattern` says otherwise), the sliding layers' rope base
10 000 (unless `gemma3.rope.freq_base_swa`), the scores scaled by head_dim ** -0.5 but for
the 62-layer (27B) shape, hidden / heads.

GPT-OSS (`gpt-oss`): its names, experts (MXFP4 or float) and config: gguf_gpt_oss.py.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ConfigError, ModelConfig, RopeScaling
from multiserve.model.errors import ModelLoadError
from multiserve.model.loading import gguf_gpt_oss

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", gguf_gpt_oss.ARCH)
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",  # Mixtral's router
}
# Mixtral's experts: the GGUF projection name (stacked `_exps` or per expert) -> HF's
_EXPERT_PROJ = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)_exps\.weight$")
_ONE_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.\d+\."
                           r"(w1|w3|w2)\.weight$")
# per architecture, where its names differ from llama's (Gemma 3's four block norms)
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {"gemma3": {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    gguf_gpt_oss.ARCH: gguf_gpt_oss.LAYER_NAMES}
# llama.cpp's norm weights are HF's plus this (module docstring)
NORM_SHIFT: dict[str, float] = {"gemma3": 1.0}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _layer_names(arch: str) -> dict[str, str]:
    return {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}


def _hf_expert_name(layer: str, proj: str, expert: int) -> str:
    return (f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            f"{_EXPERT_PROJ[proj]}.weight")


def expert_tensors(gguf_name: str, arr: np.ndarray) -> dict[str, np.ndarray] | None:
    """A Mixtral expert tensor under its HF names (a stacked one split along its first
    axis, one view per expert), or None for any other tensor."""
    m = _EXPERTS_RE.match(gguf_name)
    if m:
        return {_hf_expert_name(m.group(1), m.group(2), e): arr[e] for e in range(len(arr))}
    m = _ONE_EXPERT_RE.match(gguf_name)
    if m:
        return {_hf_expert_name(m.group(1), m.group(2), int(m.group(3))): arr}
    return None


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF tensor name of a GGUF tensor name, or None if it has no HF counterpart
    (Mixtral's expert tensors: `expert_tensors`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    names = _layer_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def gguf_name(hf: str, arch: str = "llama") -> str:
    """The GGUF tensor name of an HF tensor name (inverse of `hf_name`; a Mixtral expert's
    tensor: the stacked tensor that holds it)."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    expert = gguf_gpt_oss.gguf_expert_name(hf)
    if expert is not None:
        return expert
    m = _HF_EXPERT_RE.match(hf)
    if m:
        proj = {v: k for k, v in _EXPERT_PROJ.items()}[m.group(2)]
        return f"blk.{m.group(1)}.{proj}_exps.weight"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    inverse = {v: k for k, v in _layer_names(arch).items()}
    if m and m.group(2) in inverse:
        return f"blk.{m.group(1)}.{inverse[m.group(2)]}"
    raise KeyError(hf)


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row permutation of q/k weights (HF rotate-half -> interleaved pairs)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `llama_permute`."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on corrupt files
        raise ModelLoadError(f"{path}: cannot read GGUF file: {e}") from e


def read_metadata(reader) -> dict[str, Any]:
    """All metadata fields as python values (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def config_from_gguf(meta: dict[str, Any], source: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: unknown architecture {arch!r}; "
                             f"supported: {list(ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: missing metadata field {arch}.{key!r}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None) and not (arch == "gemma3" and scaling_type == "linear"
                                                   or arch == gguf_gpt_oss.ARCH):
        raise ModelLoadError(f"{source}: unsupported rope scaling {scaling_type!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if window and arch not in ("llama", "gemma3", gguf_gpt_oss.ARCH):
        raise ModelLoadError(f"{source}: a sliding window on {arch!r} is not supported")
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    common = dict(
        vocab_size=int(get("vocab_size", len(tokens) or None)), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=layers,
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=False,  # decided from the tensors by the caller
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),))
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if experts and arch not in ("llama", gguf_gpt_oss.ARCH):
        raise ModelLoadError(f"{source}: experts on {arch!r} are not supported")
    top_k = int(get("expert_used_count")) if experts else 0
    try:
        if arch == gguf_gpt_oss.ARCH:
            return gguf_gpt_oss.config_from_gguf(meta, common, window, source)
        if arch == "gemma3":
            return _gemma3_config(meta, common, window, scaling_type == "linear")
        if experts:
            return ModelConfig(
                architecture="mixtral", num_experts=experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True,
                moe_layers=tuple(range(layers)), sliding_window=window,
                sliding_layers=tuple(range(layers)) if window else (), **common)
        return ModelConfig(
            architecture="mistral" if window else arch, rope_scaling=None,
            attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
            sliding_window=window, sliding_layers=tuple(range(layers)) if window else (),
            **common)
    except (ConfigError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: invalid model metadata: {e}") from e


def _gemma3_config(meta: dict[str, Any], common: dict[str, Any], window: int,
                   linear: bool) -> ModelConfig:
    """Gemma 3's config from its metadata and llama.cpp's rules (module docstring)."""
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern") or 6)
    layers = common["num_layers"]
    sliding = tuple(i for i in range(layers) if (i + 1) % pattern) if window else ()
    scalar = (common["hidden_size"] // common["num_heads"] if layers == 62
              else common["head_dim"])
    scaling = (RopeScaling(factor=float(meta["gemma3.rope.scaling.factor"]),
                           rope_type="linear") if linear else None)
    return ModelConfig(
        architecture="gemma3", qk_norm=True, sliding_window=window, sliding_layers=sliding,
        rope_scaling=scaling,
        rope_local_theta=float(meta.get("gemma3.rope.freq_base_swa") or 10000.0)
        if sliding else 0.0,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=float(meta.get("gemma3.final_logit_softcapping") or 0.0),
        norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
        hidden_act="gelu_tanh", **common)


def _dequantize(tensor, source: Path) -> np.ndarray:
    from gguf import quants

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} has unsupported type {kind} "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    if kind in ("F32", "F16"):
        return np.asarray(tensor.data, dtype=np.float32)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type),
                      dtype=np.float32).reshape(shape)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """(config, float32 tensors under HF names, metadata) of a GGUF file."""
    reader = _open(path)
    meta = read_metadata(reader)
    cfg = config_from_gguf(meta, path)
    arch = meta.get("general.architecture")
    permuted = arch == "llama"  # llama.cpp's q/k row order
    shift = NORM_SHIFT.get(arch, 0.0)
    rope_freqs = [t.name for t in reader.tensors if t.name == "rope_freqs.weight"]
    if rope_freqs:
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' (precomputed rope scaling) "
                             "is not supported")
    named: dict[str, np.ndarray] = {}
    gpt_oss_experts: dict[tuple[int, str, str], np.ndarray] = {}
    for tensor in reader.tensors:
        part = gguf_gpt_oss.expert_part(tensor.name) if arch == gguf_gpt_oss.ARCH else None
        if part is not None:
            gpt_oss_experts[part] = _dequantize(tensor, path)
            continue
        name = hf_name(tensor.name, arch)
        if name is None and cfg.num_experts:
            experts = expert_tensors(tensor.name, _dequantize(tensor, path))
            if experts is not None:
                named.update(experts)
                continue
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r}")
        arr = _dequantize(tensor, path)
        if permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg.num_heads if "attn_q" in tensor.name else cfg.num_kv_heads
            if arr.ndim != 2 or arr.shape[0] % (2 * n):
                raise ModelLoadError(f"{path}: tensor {tensor.name!r} has shape "
                                     f"{arr.shape}, not [heads*head_dim, hidden]")
            arr = llama_unpermute(arr, n)
        if shift and tensor.name.endswith("norm.weight"):
            arr = (arr - np.float32(shift)).astype(np.float32)
        named[name] = arr
    if arch == gguf_gpt_oss.ARCH:
        named.update(gguf_gpt_oss.assemble_experts(gpt_oss_experts, cfg.num_layers, path))
    cfg = replace(cfg, tie_word_embeddings="lm_head.weight" not in named)
    _validate(named, cfg, path, arch)
    return cfg, named, meta


def _validate(named: dict[str, np.ndarray], cfg: ModelConfig, path: Path, arch: str) -> None:
    """Every tensor the config needs is present with its shape; errors use GGUF names."""
    from multiserve.model.loading.hf_names import hf_tensor_specs

    for name, spec in hf_tensor_specs(cfg).items():
        if name not in named:
            raise ModelLoadError(f"{path}: missing tensor {gguf_name(name, arch)!r} ({name})")
        if tuple(named[name].shape) != spec.hf_shape:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name(name, arch)!r} has shape "
                f"{list(reversed(named[name].shape))} (GGUF order), expected "
                f"{list(reversed(spec.hf_shape))}")
