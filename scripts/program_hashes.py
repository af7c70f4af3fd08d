"""The sha256 of every step program's lowered text, for a tiny random Llama engine.

A refactor of the step path must leave the programs alone: the lowered modules are the
persistent compilation cache's keys (engine/device/step_functions.py), and the same text
means the same computation. Run it on the base tree and on the change, and compare:

    .venv/bin/python scripts/program_hashes.py > /tmp/after.txt

Each line is `<config> <program> <size> <sha256 prefix>`: every FORWARD token bucket, each
HEAD's logits and sampler programs, every FUSED step size and every DECODE_STEPS program
(K decode steps per dispatch), for three engines: float32 with K = 4 decode steps per
dispatch, float32 with LoRA, bfloat16 with K = 4. Lowering only: nothing compiles.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from multiserve.config import EngineConfig, ModelConfig  # noqa: E402
from multiserve.engine.device.runner import Runner  # noqa: E402
from multiserve.engine.step_inputs.sampling_zeros import sampler_rows  # noqa: E402
from multiserve.model.loading.param_layout import param_shapes  # noqa: E402

MODEL = ModelConfig(
    architecture="llama", vocab_size=384, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
BASE: dict[str, Any] = dict(
    precompile_token_paddings=(1, 8, 64), precompile_bs_paddings=(1, 8, 64), page_size=8,
    max_running_requests=64, chunked_prefill_size=32, max_total_tokens=4096,
    max_context_len=1024, show_progress=False, warmup=False)
CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "f32-k4": ({"decode_steps_per_dispatch": 4}, "float32"),
    "f32-lora": ({"max_loras_per_batch": 2, "max_lora_rank": 8}, "float32"),
    "bf16-k4": ({"decode_steps_per_dispatch": 4}, "bfloat16"),
}


def _params(cfg: ModelConfig) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return (np.ones(shape) if "norm" in name else rng.standard_normal(shape) * 0.05
                ).astype(np.float32)

    return {k: ({n: init(n, s) for n, s in v.items()} if k == "layers" else init(k, v))
            for k, v in param_shapes(cfg).items()}


def _digest(lowered: Any) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]


def program_hashes(name: str, extra: dict[str, Any], dtype: str) -> list[str]:
    cfg = EngineConfig(**BASE, **extra)
    runner = Runner(cfg, MODEL, _params(MODEL), jax.devices()[:1], 4096 // 8 + 1,
                    jnp.dtype(dtype))
    programs = runner.step_programs
    fns = programs.functions
    max_pages = -(-1024 // cfg.page_size)
    inputs = programs._abstract_inputs(max_pages)
    lines = []
    for (kind, size), (args, layout) in sorted(inputs.items(),
                                               key=lambda kv: (kv[0][0].value, kv[0][1])):
        kind_name = kind.name
        if kind_name == "FORWARD":
            lowered = [("forward", fns.forward.lower(*args, layout=layout))]
        elif kind_name == "FUSED":
            lowered = [("fused", fns.step.lower(*args, layout=layout[0],
                                                 sample_layout=layout[1], num_rows=size))]
        elif kind_name == "HEAD":
            params, hidden, row_tok, row_prev, *sb = args
            spec = jax.ShapeDtypeStruct
            rows = sampler_rows(size)
            rep = programs.replicated
            lowered = [("logits", fns.logits.lower(params, hidden, row_tok, row_prev,
                                                   num_rows=size)),
                       ("sampler", fns.sample.lower(
                           spec((rows, MODEL.vocab_size), jnp.float32, sharding=rep),
                           spec((rows,), jnp.int32, sharding=rep),
                           spec((rows,), jnp.bool_, sharding=rep), *sb, layout=layout,
                           max_rows=programs.max_rows))]
        else:  # the program of K decode steps per dispatch
            lowered = [("steps", fns.decode_steps.lower(*args, layout=layout[0],
                                                  sample_layout=layout[1], num_rows=size,
                                                  decode_steps=cfg.decode_steps_per_dispatch))]
        lines += [f"{name} {label} {size} {_digest(low)}" for label, low in lowered]
    return lines


def main() -> int:
    for name, (extra, dtype) in CONFIGS.items():
        for line in program_hashes(name, extra, dtype):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
