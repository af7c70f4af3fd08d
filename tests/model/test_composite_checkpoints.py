"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) served as their text
model (multiserve/model/loading/hf_composite.py), from a checkpoint transformers itself
wrote (tests/family_checkpoints.py `make_gemma3_multimodal`: ARCHS["gemma3"] beside a
SigLIP tower): the text config and every text tensor read bit for bit, the vision tower's
and projector's tensors not read, logits of ragged paged batches within the families'
float32 tolerance of transformers' multimodal model on text, greedy ids equal to its
`generate`; a released checkpoint's config.json (a text_config of a few keys) maps to
the config transformers itself materialises; weight updates take the checkpoint's names."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
import torch
from checkpoint_checks import greedy_ids_and_generates, ragged_logits_diff
from family_checkpoints import ARCHS, WINDOW, make_gemma3_multimodal, make_model
from moe_checkpoints import save

from multiserve.model.loading.hf import config_from_hf
from multiserve.model.loading.hf_composite import (
    GEMMA3_TEXT_DEFAULTS,
    text_model_config,
    text_model_name,
)
from multiserve.model.loading.hf_names import params_to_hf
from multiserve.model.loading.loader import load_model
from multiserve.model.loading.safetensors_io import load_file

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
LOGITS_TOL = 1e-3  # tests/model/test_families.py's: rounding order only
_BUILT: dict[str, Any] = {}

# google/gemma-3-4b-it's config.json as released (transformers 4.50 wrote each sub-config
# as its difference from the class defaults); the vision config left out (not read)
RELEASED_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0"}


def _checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(the transformers multimodal model, its saved dir), built once."""
    if "mm" not in _BUILT:
        model = make_gemma3_multimodal(seed=6)
        _BUILT["mm"] = (model, save(model, tmp_path_factory.mktemp("gemma3-mm")))
    return _BUILT["mm"]


def test_the_text_defaults_are_transformers_gemma3_text_config() -> None:
    import transformers

    theirs = transformers.Gemma3TextConfig().to_dict()
    rope = theirs["rope_parameters"]
    for key, ours in GEMMA3_TEXT_DEFAULTS.items():
        want = {"rope_theta": rope["full_attention"]["rope_theta"],
                "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
                "sliding_window_pattern": theirs.get("_sliding_window_pattern"),
                }.get(key, theirs.get(key))
        assert ours == want, key


def test_a_released_config_maps_as_transformers_materialises_it(tmp_path) -> None:
    """The released 4B's few text keys over the defaults give the config that
    transformers' own Gemma3Config builds from the same file (every field written out)."""
    import transformers

    ours = config_from_hf(RELEASED_4B, tmp_path / "config.json")
    full = transformers.Gemma3Config(**copy.deepcopy(RELEASED_4B)).text_config.to_dict()
    full.update(architectures=["Gemma3ForCausalLM"], eos_token_id=[1, 106])
    assert ours == config_from_hf(full, tmp_path / "config.json")
    assert (ours.architecture, ours.num_layers, ours.hidden_size, ours.num_heads,
            ours.num_kv_heads, ours.head_dim, ours.vocab_size) == \
        ("gemma3", 34, 2560, 8, 4, 256, 262208)
    assert ours.sliding_window == 1024 and len(ours.sliding_layers) == 34 - 34 // 6
    assert ours.rope_scaling is not None and ours.rope_scaling.factor == 8.0
    assert (ours.rope_theta, ours.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert ours.eos_token_ids == (1, 106) and ours.tie_word_embeddings


def test_the_checkpoint_loads_as_its_text_model(tmp_path_factory) -> None:
    _, path = _checkpoint(tmp_path_factory)
    loaded = load_model(str(path))
    cfg = loaded.config
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"]
    text_only = save(make_model("gemma3", seed=0), tmp_path_factory.mktemp("gemma3-text"))
    assert cfg == load_model(str(text_only)).config  # the same text config, other weights
    assert cfg.sliding_window == WINDOW
    on_disk = load_file(path / "model.safetensors")
    ours = params_to_hf(loaded.params, cfg)
    served = {text_model_name(n, cfg.architecture): n for n in on_disk}
    unserved = served.pop(None)
    assert unserved.startswith(("vision_tower.", "multi_modal_projector."))
    assert not any(n.startswith(("vision_tower.", "multi_modal_projector."))
                   for n in served.values())
    assert set(ours) == set(served)
    for name, arr in ours.items():
        assert np.array_equal(arr, on_disk[served[name]]), name


def test_ragged_logits_and_greedy_ids_match_transformers(tmp_path_factory) -> None:
    model, path = _checkpoint(tmp_path_factory)
    diff, scale = ragged_logits_diff((model, path, path))
    print(f"gemma3 multimodal: max|logits diff| = {diff:.2e} (max|logit| = {scale:.2f})")
    assert scale > 1.0 and diff <= LOGITS_TOL
    got, want = greedy_ids_and_generates((model, path, path), 3 * WINDOW)
    assert got == want and len(set(got)) > 3


def test_weight_updates_take_the_checkpoints_names(tmp_path_factory) -> None:
    """A trainer holding the multimodal model sends its own names (transformers 5's in
    memory, or the saved ones): each lands on its text leaf, the vision tower's are
    skipped; those names stay refused for a model that has no such checkpoint."""
    from multiserve.engine.rl.checks import ParamLayout, WeightUpdateError

    model, path = _checkpoint(tmp_path_factory)
    cfg = load_model(str(path)).config
    layout = ParamLayout(cfg)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in state)
    full, partial, n = layout.validate(state, require_all=True)
    saved = load_file(path / "model.safetensors")
    full_saved, _, n_saved = layout.validate(saved, require_all=True)
    assert not partial and n == n_saved == len(params_to_hf(load_model(str(path)).params, cfg))
    assert set(full) == set(full_saved)
    for leaf in full:
        assert np.array_equal(np.asarray(full[leaf]), np.asarray(full_saved[leaf])), leaf
    vision_only = {k: v for k, v in saved.items() if k.startswith("vision_tower.")}
    with pytest.raises(WeightUpdateError, match="no tensor to update"):
        layout.validate(vision_only, require_all=False)
    llama = ParamLayout(config_from_hf({**ARCHS["mistral"], "architectures":
                                        ["MistralForCausalLM"]}, path / "config.json"))
    with pytest.raises(WeightUpdateError, match="not a parameter"):
        llama.validate(dict(list(vision_only.items())[:1]), require_all=False)


def test_other_configs_pass_through() -> None:
    raw = {**ARCHS["gemma3"], "architectures": ["Gemma3ForCausalLM"]}
    assert text_model_config(raw) is raw
    assert text_model_name("vision_tower.x", "llama") == "vision_tower.x"
