"""(no jax) GPT-OSS GGUF files (llama.cpp's `gpt-oss` architecture) read as the HF checkpoint
they were converted from; gguf.py reads every other tensor and dispatches here.

llama.cpp's converter splits each layer's interleaved `experts.gate_up_proj` [E, D, 2F]
(gate in the even columns, up in the odd) into `ffn_gate_exps` and `ffn_up_exps` [E, F, D]
(or, in its fused form, one `ffn_gate_up_exps` [E, 2F, D], the gate's rows first), their
biases likewise ([E, F] each, or [E, 2F]), and stores `experts.down_proj` [E, F, D]
transposed as `ffn_down_exps` [E, D, F]. The sinks are the `attn_sinks` weight, the router
`ffn_gate_inp` (weight and bias), the pre-MLP norm `post_attention_norm`; q/k are not
permuted (GPT-OSS's rope is rotate-half in both). Experts released in MXFP4 stay MXFP4 in
the file (ggml's MXFP4: the same E8M0 scale and E2M1 codes, the nibbles in another order):
gguf's de-quantization of them gives the float32 values transformers' de-quantization of
the released blocks gives (loading/mxfp4.py), bit for bit.

What the metadata leaves out is the architecture's own and every released GPT-OSS's: the
SwiGLU's alpha 1.702 and clamp 7.0 (llama.cpp's constants for it), biases on q/k/v/o, the
even layers sliding (llama.cpp's pattern 2). YaRN takes its factor and original context
from the metadata, beta_fast / beta_slow 32 / 1 unless the metadata has them, and its
correction range NOT rounded to whole dimensions (the released configs' `truncate: false`,
which transformers, vLLM and SGLang follow; llama.cpp rounds it, a difference of a
fraction of one dimension's ramp).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.loading.hf_rope import rope_scaling_from_hf

ARCH = "gpt-oss"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
# where its names differ from llama's (gguf.py's _LAYER_NAMES): GGUF suffix -> HF suffix
LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps\.(weight|bias)$")
_HF_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                            r"(_bias)?$")


def config_from_gguf(meta: dict[str, Any], common: dict[str, Any], window: int,
                     source: Path) -> ModelConfig:
    """GPT-OSS's config from its metadata and the architecture's rules (module docstring)."""
    def get(key: str) -> Any:
        value = meta.get(f"{ARCH}.{key}")
        if value is None:
            raise ModelLoadError(f"{source}: missing metadata field {ARCH}.{key!r}")
        return value

    layers = common["num_layers"]
    scaling = None
    kind = meta.get(f"{ARCH}.rope.scaling.type", "none")
    if kind == "yarn":
        scaling = rope_scaling_from_hf({
            "rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": meta.get(f"{ARCH}.rope.scaling.yarn_beta_fast"),
            "beta_slow": meta.get(f"{ARCH}.rope.scaling.yarn_beta_slow"),
            "truncate": False}, source)
    elif kind not in ("none", None):
        raise ModelLoadError(f"{source}: unsupported rope scaling {kind!r} for {ARCH}")
    return ModelConfig(
        architecture="gpt_oss", num_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(meta.get(f"{ARCH}.expert_feed_forward_length")
                                  or common["intermediate_size"]),
        moe_layers=tuple(range(layers)), sliding_window=window,
        sliding_layers=tuple(range(0, layers, 2)) if window else (),
        attention_bias=True, o_proj_bias=True, attention_sinks=True, norm_weight_f32=True,
        swiglu_limit=SWIGLU_LIMIT, swiglu_alpha=SWIGLU_ALPHA, rope_scaling=scaling, **common)


def expert_part(gguf_name: str) -> tuple[int, str, str] | None:
    """(layer, projection, weight | bias) of an expert tensor the HF tensors are assembled
    from (`assemble_experts`), or None for any other tensor (down_proj's bias is mapped
    by name: LAYER_NAMES)."""
    m = _EXPERTS_RE.match(gguf_name)
    if m is None or (m.group(2) == "down" and m.group(3) == "bias"):
        return None
    return int(m.group(1)), m.group(2), m.group(3)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., 2F] with gate in the even and up in the odd columns (HF's layout)."""
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out


def assemble_experts(parts: dict[tuple[int, str, str], np.ndarray], layers: int,
                     source: Path) -> dict[str, np.ndarray]:
    """The HF expert tensors (`experts.gate_up_proj` [E, D, 2F] and its bias [E, 2F],
    `experts.down_proj` [E, F, D]) of each layer from its GGUF expert tensors (float32,
    GGUF's numpy order)."""
    def part(layer: int, proj: str, kind: str) -> np.ndarray:
        if (layer, proj, kind) not in parts:
            raise ModelLoadError(f"{source}: missing tensor 'blk.{layer}.ffn_{proj}_exps.{kind}'")
        return parts[(layer, proj, kind)]

    out: dict[str, np.ndarray] = {}
    for i in range(layers):
        pre = f"model.layers.{i}.mlp.experts."
        fused = (i, "gate_up", "weight") in parts
        gates_ups = []
        for kind in ("weight", "bias"):
            if fused:
                both = part(i, "gate_up", kind)
                axis = 1 if kind == "weight" else -1
                if both.ndim < 2 or both.shape[axis] % 2:
                    raise ModelLoadError(f"{source}: tensor 'blk.{i}.ffn_gate_up_exps.{kind}' "
                                         f"has shape {list(both.shape)}: no gate / up halves")
                gate, up = np.split(both, 2, axis=axis)
            else:
                gate, up = part(i, "gate", kind), part(i, "up", kind)
            if gate.shape != up.shape:
                raise ModelLoadError(f"{source}: layer {i}'s gate and up experts differ in "
                                     f"shape: {list(gate.shape)} vs {list(up.shape)}")
            gates_ups.append((gate, up))
        (gate_w, up_w), (gate_b, up_b) = gates_ups
        if gate_w.ndim != 3:
            raise ModelLoadError(f"{source}: layer {i}'s gate experts have shape "
                                 f"{list(gate_w.shape)}, not [E, F, D]")
        out[pre + "gate_up_proj"] = _interleave(gate_w.transpose(0, 2, 1), up_w.transpose(0, 2, 1))
        out[pre + "gate_up_proj_bias"] = _interleave(gate_b, up_b)
        down = part(i, "down", "weight")
        if down.ndim != 3:
            raise ModelLoadError(f"{source}: tensor 'blk.{i}.ffn_down_exps.weight' has shape "
                                 f"{list(down.shape)}, not [E, D, F]")
        out[pre + "down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
    return out


def gguf_expert_name(hf: str) -> str | None:
    """The GGUF tensor an HF expert tensor is assembled from (its gate's, for the fused
    gate_up), or None for any other HF name."""
    m = _HF_EXPERTS_RE.match(hf)
    if m is None:
        return None
    proj = "gate" if m.group(2) == "gate_up_proj" else "down"
    return f"blk.{m.group(1)}.ffn_{proj}_exps.{'bias' if m.group(3) else 'weight'}"
