"""(no jax) Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`)
behind the model interface (families/base.py).

Both: every RMSNorm scales by (1 + weight) in float32; each block is wrapped in a pre- and a
post-norm (input / post_attention / pre_feedforward / post_feedforward layernorms: the
layout's post_attn_norm and post_mlp_norm, dense.SANDWICH_HF_NAMES); the embeddings are
scaled by sqrt(hidden_size); the MLP is GeGLU (gelu_pytorch_tanh); the scores' scale is
query_pre_attn_scalar ** -0.5; sliding-window layers interleave with global ones
(`layer_types`; by default Gemma 2 alternates, Gemma 3 slides 5 layers of 6); the
embeddings are tied by default. Gemma 2 soft-caps the attention scores and the final
logits; Gemma 3 normalises q and k (Gemma's norm) and gives its sliding layers their own
rope base (10 000, unscaled) beside the global layers' (1 000 000, optionally linearly
scaled); it soft-caps only the final logits, and only where its config says (transformers'
Gemma 3 attention takes no score cap). Everything else is the dense families' (dense.py);
the forward is llama.py's, reading these from the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.families.dense import CONFIG_FIELDS, DenseFamily
from multiserve.model.loading.hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from multiserve.model.families.sliding import layer_types_to_hf, sliding_from_hf

if TYPE_CHECKING:  # the step's types (jax): for the checker only, this module stays jax-free
    from multiserve.model.invariance.plan import InvariancePlan

ARCH_GEMMA2, ARCH_GEMMA3 = "gemma2", "gemma3"
GEMMA_FIELDS = ("sliding_window", "sliding_layers", "rope_local_theta",
                "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping")
# transformers' defaults where a config leaves them out
DEFAULT_PATTERN = {ARCH_GEMMA2: 2, ARCH_GEMMA3: 6}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma 3's rope bases


def _rope_bases(raw: dict[str, Any], source: Path) -> tuple[float, float, Any]:
    """Gemma 3's (global theta, local theta, global rope scaling) from `rope_parameters`
    per layer type (transformers 5) or `rope_theta` / `rope_local_base_freq` /
    `rope_scaling` (before it)."""
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") if isinstance(params.get("full_attention"),
                                                      dict) else None
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"),
                                                          dict) else None
    if full is None:
        full = {"rope_theta": raw.get("rope_theta", GLOBAL_THETA),
                **(raw.get("rope_scaling") or {})}
    if local is None:
        local = {"rope_theta": raw.get("rope_local_base_freq", LOCAL_THETA)}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: rope scaling on Gemma 3's sliding layers "
                             f"({local}) is not supported")
    return (float(full.get("rope_theta", GLOBAL_THETA)),
            float(local.get("rope_theta", LOCAL_THETA)), rope_scaling_from_hf(full, source))


class GemmaFamily(DenseFamily):
    """Gemma 2 and Gemma 3 (see module docstring)."""

    name = "gemma"
    architectures = {"Gemma2ForCausalLM": ARCH_GEMMA2, "Gemma3ForCausalLM": ARCH_GEMMA3}
    model_types: tuple[str, ...] = ("gemma2", "gemma3_text")
    config_fields: tuple[str, ...] = CONFIG_FIELDS + GEMMA_FIELDS

    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig:
        if raw.get("attention_bias") or raw.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: {arch} with attention_bias or bidirectional "
                                 "attention is not supported")
        if common["hidden_act"] != "gelu_tanh":
            raise ModelLoadError(f"{source}: {arch}'s MLP activation must be "
                                 "gelu_pytorch_tanh")
        window, layers = sliding_from_hf(raw, common["num_layers"], source,
                                         DEFAULT_PATTERN[arch])
        out = {**common, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}
        gemma3 = arch == ARCH_GEMMA3
        if gemma3:
            theta, local, scaling = _rope_bases(raw, source)
            out.update(rope_theta=theta, rope_scaling=scaling,
                       rope_local_theta=local if layers else 0.0)
        return ModelConfig(
            architecture=arch, qk_norm=gemma3, sliding_window=window, sliding_layers=layers,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
            attn_logit_softcapping=0.0 if gemma3 else float(
                raw.get("attn_logit_softcapping") or 0.0),
            final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0),
            norm_plus_one=True, sandwich_norms=True, scale_embeddings=True, **out)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            # transformers' config types it int
            "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar)
            if cfg.query_pre_attn_scalar == int(cfg.query_pre_attn_scalar)
            else cfg.query_pre_attn_scalar,
            "sliding_window": cfg.sliding_window or None,
            "layer_types": layer_types_to_hf(cfg.num_layers, cfg.sliding_layers),
            "final_logit_softcapping": cfg.final_logit_softcapping or None,
            "attn_logit_softcapping": cfg.attn_logit_softcapping or None,
            "attention_bias": False}
        if cfg.architecture == ARCH_GEMMA3:
            full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
            if cfg.rope_scaling is not None:
                full.update(rope_scaling_to_hf(cfg.rope_scaling))
            out.update(model_type="gemma3_text", rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": cfg.rope_local_theta or LOCAL_THETA}})
        return out

    def scans(self, plan: InvariancePlan, num_tokens: int) -> bool:
        """Every step size scans its layers (llama.scans: the sandwich norms)."""
        return True
