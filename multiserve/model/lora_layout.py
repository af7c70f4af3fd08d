"""The LoRA adapter buffers' layout (no jax: the host side that parses adapters reads it).

Per target module m (our layer key, `LORA_MODULES`): `<m>_a` [L, S, K, r] and `<m>_b`
[L, S, r, N], A and B stored [in, out] (PEFT stores lora_A.weight [r, in] and
lora_B.weight [out, r]), and `scale` [S] float32. S slots of rank r; slot 0 is "no
adapter". The forward that reads them is model/layers/lora.py.

Where the forward's LoRA form is the native CPU kernel, B is also held panel by panel:
`<m>_bp` [L, S, ceil(N / 64), r, 64] (`b_panels`: element (l, s, p, j, c) = B[l, s, j,
64p + c], zero past N), so the one-token kernel (model/kernels/src/row_gemm_lora.cc) reads
the r x 64 values of one product panel's columns as one contiguous block. Both copies are
written together whenever a slot is (the runner's `write_lora`), so they always hold the
same values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from multiserve.config import ModelConfig

# the native products' panel width (model/kernels/native.py PANEL): B's panel blocks
B_PANEL = 64

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


def lora_b_panel_shapes(cfg: ModelConfig, slots: int, rank: int
                        ) -> dict[str, tuple[int, ...]]:
    """The shapes of B's panel copies `<m>_bp` (module docstring) beside
    `lora_buffer_shapes`' `<m>_b`."""
    return {f"{m}_bp": (cfg.num_layers, slots, -(-n // B_PANEL), rank, B_PANEL)
            for m, (_, n) in module_shapes(cfg).items()}


def b_panels(b: Any, xp: Any = np) -> Any:
    """B [..., r, N] -> its panel copy [..., ceil(N / 64), r, 64] (columns past N zero):
    values moved, never rounded. `xp`: the array module of `b` (numpy or jax.numpy)."""
    n = b.shape[-1]
    width = -(-n // B_PANEL) * B_PANEL
    if width > n:
        b = xp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, width - n)])
    b = b.reshape(*b.shape[:-1], width // B_PANEL, B_PANEL)
    return xp.swapaxes(b, -3, -2)
