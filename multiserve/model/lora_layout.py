"""The LoRA adapter buffers' layout (no jax: the host side that parses adapters reads it).

Per target module m (our layer key, `LORA_MODULES`): `<m>_a` [L, S, K, r] and `<m>_b`
[L, S, r, N], A and B stored [in, out] (PEFT stores lora_A.weight [r, in] and
lora_B.weight [out, r]), and `scale` [S] float32. S slots of rank r; slot 0 is "no
adapter". The forward that reads them is model/layers/lora.py.
"""

from __future__ import annotations

from multiserve.config import ModelConfig

# the projections an adapter may target: our layer key -> PEFT's module name
LORA_MODULES: dict[str, str] = {
    "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
    "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target module."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return {"wq": (d, qd), "wk": (d, kvd), "wv": (d, kvd), "wo": (qd, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


def lora_buffer_shapes(cfg: ModelConfig, slots: int, rank: int
                       ) -> dict[str, tuple[int, ...]]:
    """The shapes of the adapter buffers of `slots` slots (slot 0 included) of `rank`."""
    shapes: dict[str, tuple[int, ...]] = {"scale": (slots,)}
    for m, (k, n) in module_shapes(cfg).items():
        shapes[f"{m}_a"] = (cfg.num_layers, slots, k, rank)
        shapes[f"{m}_b"] = (cfg.num_layers, slots, rank, n)
    return shapes
