"""bfloat16 (the accelerator default): params and KV pool in bf16 run the same forward,
return float32 logits, and stay close to the float32 forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from model_helpers import TINY_LLAMA, PagedSim

from multiserve.model.loading.param_layout import init_random_params


def test_bf16_forward_is_close_to_f32() -> None:
    host = init_random_params(TINY_LLAMA, seed=5, scale=0.3)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(3, TINY_LLAMA.vocab_size, 40)]
    out = {}
    for name, dtype in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16)):
        params = jax.device_put(jax.tree.map(lambda a, d=dtype: a.astype(d), host))
        sim = PagedSim(params, TINY_LLAMA, page_size=4, block_size=8, num_pages=64)
        assert sim.kv.k.dtype == jnp.dtype(dtype)
        sim.add("a", toks)
        got = sim.step([("a", 30)], logits_for={"a": list(range(30))})
        for _ in range(10):
            got.update(sim.step([("a", 1)]))
        out[name] = np.stack([got[("a", p)] for p in range(40)])
    assert out["bf16"].dtype == np.float32
    scale = np.max(np.abs(out["f32"]))
    assert np.max(np.abs(out["bf16"] - out["f32"])) < 0.1 * scale
    agree = np.mean(np.argmax(out["bf16"], -1) == np.argmax(out["f32"], -1))
    assert agree >= 0.8, agree
