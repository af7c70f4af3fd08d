"""Random LoRA adapters for tests: PEFT-named tensors and PEFT adapter directories for a
ModelConfig (lora_A [r, in] ~ N(0, 1/in), lora_B [out, r] ~ N(0, 1/r): large enough to
change a tiny model's greedy output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.lora_layout import LORA_MODULES, module_shapes

BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_tensors(cfg: ModelConfig, r: int, seed: int,
                 modules: tuple[str, ...] = tuple(BLOCKS)) -> dict[str, np.ndarray]:
    """PEFT-named lora_A / lora_B of `modules` (PEFT names) in every layer."""
    rng = np.random.default_rng(seed)
    shapes = {LORA_MODULES[k]: v for k, v in module_shapes(cfg).items()}
    out = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            k, n = shapes[m]
            base = f"base_model.model.model.layers.{layer}.{BLOCKS[m]}.{m}"
            out[f"{base}.lora_A.weight"] = (rng.standard_normal((r, k)) / np.sqrt(k)
                                            ).astype(np.float32)
            out[f"{base}.lora_B.weight"] = (rng.standard_normal((n, r)) / np.sqrt(r)
                                            ).astype(np.float32)
    return out


def write_peft_dir(path: Path, cfg: ModelConfig, r: int, seed: int,
                   modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")) -> Path:
    """A PEFT adapter directory (lora_alpha = 2r) of `modules`."""
    from multiserve.model.loading import safetensors_io

    path.mkdir(parents=True, exist_ok=True)
    safetensors_io.save_file(peft_tensors(cfg, r, seed, modules),
                             path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(modules)}))
    return path


def assert_matches_peft(engine: Any, model: Any, prompts: list[list[int]], lora_name: str,
                        params: Any) -> None:
    """For each prompt, the engine's greedy output with adapter `lora_name` is the argmax
    of transformers + peft's `model` over that output, each token's logprob within 1e-4
    of the model's (float32 sums in other orders), and the adapter matters (the base
    model's argmax differs somewhere)."""
    import torch

    for prompt in prompts:
        out = engine.generate(input_ids=prompt, sampling_params=params, lora_name=lora_name)
        ids = torch.tensor([prompt + list(out.output_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        logprobs = torch.log_softmax(logits, -1)
        n = len(prompt)
        want_ids = [int(i) for i in logits[n - 1:-1].argmax(-1)]
        assert list(out.output_ids) == want_ids
        want = [float(logprobs[n - 1 + j, t]) for j, t in enumerate(out.output_ids)]
        np.testing.assert_allclose([t.logprob for t in out.logprobs], want, rtol=0,
                                   atol=1e-4)
        with torch.no_grad(), model.disable_adapter():
            base_ids = [int(i) for i in model(ids).logits[0][n - 1:-1].argmax(-1)]
        assert base_ids != want_ids


def loaded(result: Any) -> dict[str, Any]:
    """The details of a LoRA load or unload that succeeded (a ControlResult)."""
    assert result.ok, result.message
    return result.details


def refused(result: Any, kind: str, match: str = "") -> str:
    """Assert a LoRA operation was refused (a ControlResult with ok false) for `kind`
    ("invalid", "unknown", "exists", "full", "in_use"), its message containing `match`;
    returns the message."""
    assert not result.ok and result.details["error_kind"] == kind, result
    assert match in result.message, (match, result.message)
    return result.message
