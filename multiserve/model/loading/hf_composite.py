"""(no jax) The text model of a multimodal Hugging Face checkpoint, served as its text family.

Gemma 3's released 4B / 12B / 27B checkpoints are `Gemma3ForConditionalGeneration`: a
Gemma 3 text model (`text_config`, tensors under `language_model.model.` as saved, or
`model.language_model.` as transformers 5 names them in memory) beside a SigLIP vision tower
and a projector that turns image patches into soft tokens. multiserve serves the text model:
the config becomes a `Gemma3ForCausalLM` config, the text tensors take `Gemma3ForCausalLM`'s
names and the vision tower's and projector's tensors are not read. A request carrying an
image is refused by the chat layer (only text parts are accepted), so nothing is served as
if an image had been seen.

Invariants: a composite's text config is transformers' text-config class defaults updated
by the checkpoint's `text_config` (transformers saves a sub-config as its difference from
those defaults: the released checkpoints' `text_config` holds a handful of keys); a tensor
name maps to at most one text-model name, and only for the architectures listed here, so a
Llama checkpoint holding `vision_tower.*` tensors is still refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Composite:
    """A multimodal architecture whose text model a family serves."""

    text_architecture: str  # the HF class of the text model alone
    architecture: str  # ours (model/families), the key of the tensor renaming
    text_prefixes: tuple[str, ...]  # where its text model's `model.` tensors live
    head_names: tuple[str, ...]  # its `lm_head.weight`, as saved or as named in memory
    unserved_prefixes: tuple[str, ...]  # the vision tower's and projector's tensors
    text_defaults: dict[str, Any]  # transformers' text-config defaults (see module doc)


# transformers 5.24's Gemma3TextConfig() (tests/model/test_composite_checkpoints.py checks
# them against the installed transformers); without `layer_types`, 5 sliding layers then
# a global one, repeated (`sliding_window_pattern`).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False, "sliding_window_pattern": 6,
    # the rope bases in the spelling before transformers 5 (global, sliding layers): a
    # checkpoint's `rope_parameters` (transformers 5) is read before them
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}

COMPOSITES: dict[str, Composite] = {
    "Gemma3ForConditionalGeneration": Composite(
        text_architecture="Gemma3ForCausalLM", architecture="gemma3",
        text_prefixes=("language_model.model.", "model.language_model."),
        head_names=("language_model.lm_head.weight", "lm_head.weight"),
        unserved_prefixes=("vision_tower.", "multi_modal_projector.",
                           "model.vision_tower.", "model.multi_modal_projector."),
        text_defaults=GEMMA3_TEXT_DEFAULTS),
}
_BY_ARCHITECTURE = {c.architecture: c for c in COMPOSITES.values()}


def composite_of(raw: dict[str, Any]) -> Composite | None:
    """The composite `raw` (a config.json dict) is, if any."""
    return next((COMPOSITES[a] for a in raw.get("architectures") or [] if a in COMPOSITES),
                None)


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` itself, or for a composite the config.json dict of its text model alone: the
    text-config defaults, the checkpoint's `text_config` over them, the token ids and the
    head's tying the top level states where the text config leaves them out."""
    composite = composite_of(raw)
    if composite is None:
        return raw
    given = raw.get("text_config") or {}
    text = {**composite.text_defaults, **given}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw and key not in given:
            text[key] = raw[key]
    text["architectures"] = [composite.text_architecture]
    return text


def text_model_name(name: str, architecture: str) -> str | None:
    """The text model's HF name of a composite checkpoint's tensor `name` (unchanged where
    `architecture` has no composite or the name is already the text model's); None for a
    tensor of the parts not served (the vision tower, the projector)."""
    composite = _BY_ARCHITECTURE.get(architecture)
    if composite is None:
        return name
    if name in composite.head_names:
        return "lm_head.weight"
    for prefix in composite.text_prefixes:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith(composite.unserved_prefixes):
        return None
    return name


def text_model_tensors(named: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`named` with each tensor under its text-model name and the unserved parts left out
    (the same dict where `architecture` has no composite)."""
    if architecture not in _BY_ARCHITECTURE:
        return named
    out: dict[str, Any] = {}
    for name, x in named.items():
        text = text_model_name(name, architecture)
        if text is not None:
            out[text] = x
    return out
