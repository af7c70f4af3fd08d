"""Time one forward step (decoder + head, the invariance plan of a default engine) of a
random MoE model against a dense model of the same ACTIVE size (same attention, dense
intermediate = top-k x expert intermediate), at T = 1 (a lone decode) and T = 64 tokens.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \\
        python scripts/bench_moe_step.py [--steps 300] [--sizes tiny small]

The first run of a size calibrates both models' invariance plans (cached afterwards).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.families import family_for
from multiserve.model.families.forward import forward
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import make_kv_pool
from multiserve.model.loading.param_layout import init_random_params

SIZES = {  # name -> (hidden, layers, heads, kv heads, experts, top-k, expert intermediate)
    "tiny": (64, 3, 4, 2, 8, 2, 32),
    "small": (512, 4, 8, 4, 16, 2, 256),
}


def configs(hidden: int, layers: int, heads: int, kv: int, experts: int, k: int, f: int
            ) -> tuple[ModelConfig, ModelConfig]:
    base = dict(vocab_size=512, hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=kv, head_dim=hidden // heads, qk_norm=True)
    moe = ModelConfig(architecture="qwen3_moe", intermediate_size=f * k, num_experts=experts,
                      num_experts_per_tok=k, moe_intermediate_size=f, norm_topk_prob=True,
                      moe_layers=tuple(range(layers)), **base)
    dense = ModelConfig(architecture="qwen3", intermediate_size=f * k, **base)
    return moe, dense


def step_seconds(cfg: ModelConfig, tokens: int, steps: int) -> float:
    page = 16
    plan = default_plan(cfg, np.float32)
    params = family_for(cfg).compute_params(
        jax.device_put(init_random_params(cfg, seed=0, scale=0.1)), cfg, plan, (tokens,))
    kv = make_kv_pool(cfg, 16, page, jnp.float32)
    pos = np.arange(tokens, dtype=np.int32) + 100
    batch = ForwardBatch(
        input_ids=jnp.asarray(np.random.default_rng(0).integers(3, 500, tokens), jnp.int32),
        positions=jnp.asarray(pos), token_seq=jnp.zeros(tokens, jnp.int32),
        out_slots=jnp.asarray(page + pos % (14 * page), jnp.int32),
        page_table=jnp.asarray(np.arange(1, 15, dtype=np.int32)[None]),
        seq_lens=jnp.asarray([int(pos[-1]) + 1], jnp.int32),
        logit_rows=jnp.zeros(1, jnp.int32))
    fn = jax.jit(partial(forward, cfg=cfg, page_size=page, attn_block_size=128, plan=plan),
                 donate_argnums=(1,))
    for _ in range(5):
        logits, kv = fn(params, kv, batch)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, kv = fn(params, kv, batch)
    jax.block_until_ready(logits)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    for name in args.sizes:
        moe, dense = configs(*SIZES[name])
        for tokens in (1, 64):
            steps = args.steps if tokens == 1 else max(20, args.steps // 10)
            m, d = step_seconds(moe, tokens, steps), step_seconds(dense, tokens, steps)
            print(f"{name:5s} T={tokens:3d}: MoE {m * 1e3:7.3f} ms  dense(same active) "
                  f"{d * 1e3:7.3f} ms  ratio {m / d:.2f}")


if __name__ == "__main__":
    main()
