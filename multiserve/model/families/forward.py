"""The whole forward of any model family (model/families): its decoder to the final-normed
hidden states, then the output head, logits in float32 (`forward_routed`: and a MoE
model's routed experts). For code that runs a model outside an engine (simple_generate,
tests); the engine runs the two halves as separate programs
(engine/device/step_functions.py). jit with cfg/page_size/attn_block_size/plan/tp static
(`tp`: model/tensor_parallel.py, for params split over several devices; None: one)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from multiserve.config import ModelConfig
from multiserve.model.families import family_for
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import KVPool
from multiserve.model.tensor_parallel import TensorParallel


def forward(params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch, cfg: ModelConfig,
            *, page_size: int, attn_block_size: int, plan: InvariancePlan,
            tp: TensorParallel | None = None) -> tuple[jax.Array, KVPool]:
    """(logits f32 [R, V], new kv_pool) of `batch` on the family's compute params."""
    family = family_for(cfg)
    h, kv_pool = family.forward_hidden(params, kv_pool, batch, cfg, page_size=page_size,
                                       attn_block_size=attn_block_size, plan=plan, tp=tp)
    return family.lm_head(params, h, plan, cfg).astype(jnp.float32), kv_pool


def forward_routed(params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                   cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                   plan: InvariancePlan, tp: TensorParallel | None = None
                   ) -> tuple[jax.Array, KVPool, jax.Array]:
    """`forward` of a mixture-of-experts model and the top-k expert ids every token row
    chose in every MoE layer, [T, len(cfg.moe_layers), k] int32 (ValueError: dense)."""
    family = family_for(cfg)
    h, kv_pool, experts = family.forward_hidden_routed(
        params, kv_pool, batch, cfg, page_size=page_size, attn_block_size=attn_block_size,
        plan=plan, tp=tp)
    return family.lm_head(params, h, plan, cfg).astype(jnp.float32), kv_pool, experts
