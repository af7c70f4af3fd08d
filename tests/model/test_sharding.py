"""Tensor-parallel forward on 2 and 4 virtual CPU devices equals the single-device forward
(within 1e-4), for a config whose heads divide (attention sharded), a SmolLM2-like one whose
heads do not (attention replicated, MLP and vocab sharded), and a qwen2 one (biases); no
product splits its contraction (model/tensor_parallel.py)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from model_helpers import PagedSim

from multiserve.config import ModelConfig
from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.invariance.workload import workload_for
from multiserve.model.loading.param_layout import init_random_params
from multiserve.model.sharding import kv_pool_sharding, make_mesh, param_specs, shard_params
from multiserve.model.tensor_parallel import TensorParallel

BASE = dict(vocab_size=256, intermediate_size=128, num_layers=2, rms_norm_eps=1e-5)
CONFIGS = {
    "heads_divide": ModelConfig(architecture="llama", hidden_size=64, num_heads=8,
                                num_kv_heads=4, head_dim=8, **BASE),
    "smollm_like": ModelConfig(architecture="llama", hidden_size=96, num_heads=6,
                               num_kv_heads=3, head_dim=16, tie_word_embeddings=True, **BASE),
    "qwen2_bias": ModelConfig(architecture="qwen2", hidden_size=64, num_heads=4,
                              num_kv_heads=4, head_dim=16, attention_bias=True, **BASE),
}
SCHEDULE = [[("a", 40), ("b", 9)], [("a", 1), ("b", 1), ("c", 20)],
            [("c", 1), ("a", 1)], [("a", 1), ("b", 1), ("c", 1)]]


T = 64  # every step's token (and logits-row) count
_PLANS: dict[str, InvariancePlan] = {}


def plan_for(cfg: ModelConfig) -> InvariancePlan:
    """A calibrated plan for exactly the sizes these steps run (T tokens, T rows). Both
    forwards of a comparison run this one plan, so what differs between them is only the
    sharding; probing a default engine's ten token sizes as well (PagedSim's default
    plan) was most of this file's time."""
    key = repr(cfg)
    if key not in _PLANS:
        workload = workload_for(cfg, (T,), (T,), T, 4, 16, np.float32, engine_defaults=False)
        _PLANS[key] = calibrate(workload, jax.devices()[0]).plan
        assert _PLANS[key].verified
    return _PLANS[key]


def run(params, cfg: ModelConfig, kv_sharding=None, tp=None) -> dict:
    rng = np.random.default_rng(0)
    sim = PagedSim(params, cfg, page_size=4, block_size=16, num_pages=128,
                   kv_sharding=kv_sharding, plan=plan_for(cfg), tp=tp)
    for k in "abc":
        sim.add(k, [int(t) for t in rng.integers(3, cfg.vocab_size, 45)])
    got: dict = {}
    for i, work in enumerate(SCHEDULE):
        got.update(sim.step(work, T=T, R=T, rows=np.random.default_rng(i)))
    return got


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_forward_matches_single_device(name: str, n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS from tests/conftest.py)")
    cfg = CONFIGS[name]
    host = init_random_params(cfg, seed=3, scale=0.3)
    ref = run(jax.device_put(host, jax.devices()[0]), cfg)
    mesh = make_mesh(jax.devices()[:n])
    params = shard_params(host, cfg, mesh)
    got = run(params, cfg, kv_sharding=kv_pool_sharding(cfg, mesh),
              tp=TensorParallel.of(mesh, cfg))
    assert set(got) == set(ref)
    diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    print(f"{name} n={n}: max|diff| = {diff:.2e}")
    assert diff <= 1e-4


def test_sharding_rule_follows_divisibility() -> None:
    mesh = make_mesh(jax.devices()[:2])
    smol = param_specs(CONFIGS["smollm_like"], mesh)  # 6 heads / 3 kv heads: kv 3 is odd
    assert smol["layers"]["wq"] == P()
    assert smol["layers"]["w_gate"] == P(None, None, "tensor")
    # the products back into the residual stream split their output (hidden 96 divides)
    assert smol["layers"]["wo"] == P(None, None, "tensor")
    assert smol["layers"]["w_down"] == P(None, None, "tensor")
    assert smol["embed"] == P("tensor", None)
    div = param_specs(CONFIGS["heads_divide"], mesh)
    assert div["layers"]["wk"] == P(None, None, "tensor")
    # no layer matrix [L, in, out] of any config splits its contraction (the sums stay
    # whole on one device: model/tensor_parallel.py)
    for cfg in CONFIGS.values():
        specs = param_specs(cfg, make_mesh(jax.devices()[:min(4, jax.device_count())]))
        for key, spec in specs["layers"].items():
            assert len(spec) < 3 or spec[1] is None, (key, spec)
    assert kv_pool_sharding(CONFIGS["heads_divide"], mesh).spec == P(None, "tensor", None, None)
    assert kv_pool_sharding(CONFIGS["smollm_like"], mesh).spec == P()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_rows_from_a_vocabulary_split_table_are_its_bits(dtype: str) -> None:
    """The lookup moves a row's bits from the device holding it (summed as integers
    with the other devices' zeros): -0.0 and NaN survive, as no float sum would keep
    -0.0; and its program holds no float all-reduce."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from multiserve.model.tensor_parallel import embed_rows

    n = min(4, jax.device_count())
    if n < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS from tests/conftest.py)")
    mesh = make_mesh(jax.devices()[:n])
    table = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    table[5, 3], table[7, 1] = -0.0, np.nan
    table = np.asarray(jnp.asarray(table, dtype))
    ids = jnp.asarray([5, 7, 0, 63, 16, 15, 32, 5], jnp.int32)
    lookup = jax.jit(lambda e, i: embed_rows(e, i, TensorParallel(mesh, vocab_split=True)))
    split = jax.device_put(table, NamedSharding(mesh, P("tensor", None)))
    got = np.asarray(lookup(split, ids))
    word = np.uint32 if dtype == "float32" else np.uint16
    assert np.array_equal(got.view(word), table[np.asarray(ids)].view(word))
    text = lookup.lower(split, ids).compile().as_text()
    assert not re.search(r"= \(?(f32|bf16)\[[^ ]* all-reduce", text), text
