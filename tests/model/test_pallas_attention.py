"""The Pallas attention kernels (model/layers/attention_pallas.py) on the CPU, in Pallas
interpret mode: against the XLA formulation over a mixed step (decode rows and a prefill
chunk, several pages, GQA), row invariance bitwise, and the calibration choosing them when
forced (MULTISERVE_ATTENTION_KERNEL).

Tolerances (max abs difference from the XLA formulation, unit-variance random q/K/V):
float32 pool: 1e-5 for both (reassociation only: the TPU kernel (layers/attention_tpu.py)
computes in float32 there). bfloat16 pool: 2e-2 for both (outputs are bfloat16, one ulp
near 1 is 2^-7; the kernels also round q, and the GPU kernel its split partials, the TPU
kernel its probabilities, to bfloat16 for the products). The tiny model's logits (float32):
1e-3 for both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.plan import AttentionPlan
from multiserve.model.layers import attention_pallas, attention_tpu
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_pallas import FORCE_ENV, pinned_blocks
from multiserve.model.layers.attention_terms import PLAIN_ATTENTION, AttentionTerms
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import pool_layout, to_lanes

LAYERS, KV, GROUP, HEAD_DIM, PAGE = 2, 2, 2, 16, 4
PAGES = 24
BLOCK = 8  # the XLA formulation's key block
# sequence 0: 14 pages (a long decode row: more than one pinned GPU split at page size 4);
# sequence 1: 5 pages (a prefill chunk across pages); sequence 2: 3 pages
TABLE = np.zeros((3, 16), np.int32)
TABLE[0, :14] = np.arange(1, 15)
TABLE[1, :5] = np.arange(15, 20)
TABLE[2, :3] = np.arange(20, 23)
# a mixed step: decode rows of sequences 0 and 2, a prefill chunk of sequence 1 (positions
# 3..12, across pages 0..3)
SEQ = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2], np.int32)
POS = np.array([53, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 9], np.int32)
TOLERANCE = {("pallas_gpu", "float32"): 1e-5, ("pallas_tpu", "float32"): 1e-5,
             ("pallas_gpu", "bfloat16"): 2e-2, ("pallas_tpu", "bfloat16"): 2e-2}
KERNELS = ("pallas_gpu", "pallas_tpu")


@pytest.fixture(params=["pinned", "small"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The pinned block sizes, or small ones (compute blocks of 2 pages, GPU splits of 4:
    sequence 0's decode row then spans 4 splits, 2 of them partly past its length)."""
    if request.param == "small":
        monkeypatch.setattr(attention_pallas, "COMPUTE_BLOCK_TOKENS", 2 * PAGE)
        monkeypatch.setattr(attention_pallas, "SPLIT_TOKENS", 4 * PAGE)
        # the TPU kernel: key blocks of 2 pages, query blocks of 4 tokens (the prefill
        # chunk then spans 3 query blocks, one of them shared with a decode row)
        monkeypatch.setattr(attention_tpu, "KEY_BLOCK_TOKENS", 2 * PAGE)
        monkeypatch.setattr(attention_tpu, "QUERY_BLOCK", 4)
    return str(request.param)


def _pools(dtype: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(7)
    shape = (LAYERS, KV, PAGES * PAGE, HEAD_DIM)
    q = rng.standard_normal((len(SEQ), KV * GROUP, HEAD_DIM))
    return (jnp.asarray(q, dtype), jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))


def _batch(pos: np.ndarray, seq: np.ndarray) -> ForwardBatch:
    n = len(pos)
    return ForwardBatch(input_ids=jnp.zeros(n, jnp.int32), positions=jnp.asarray(pos),
                        token_seq=jnp.asarray(seq), out_slots=jnp.zeros(n, jnp.int32),
                        page_table=jnp.asarray(TABLE),
                        seq_lens=jnp.zeros(TABLE.shape[0], jnp.int32),
                        logit_rows=jnp.zeros(1, jnp.int32))


# the layer's terms: plain, or a window of 9 (traced, as in a scanned decoder: the decode
# row of sequence 0 then starts in page 11, so under the small blocks its first compute
# block reaches into the next split's page 12), sinks, a soft cap and a scale
SINKS = np.random.default_rng(5).standard_normal(KV * GROUP).astype(np.float32)
TERMS = ("plain", "terms")


def _terms(kind: str) -> AttentionTerms:
    if kind == "plain":
        return PLAIN_ATTENTION
    return AttentionTerms(window=jnp.int32(9), sinks=jnp.asarray(SINKS), scale=0.3,
                          softcap=1.5)


def _attend(kernel: str, interpret: bool = True,  # type: ignore[no-untyped-def]
            terms: str = "plain"):
    """jit(q, k_pool, v_pool, layer (traced, as in the scanned decoder), pos, seq)."""

    def run(q, k, v, layer, pos, seq):  # type: ignore[no-untyped-def]
        n = q.shape[0]
        if pool_layout(kernel) == "lanes":  # the same values in the kernel's pool layout
            k, v = to_lanes(k), to_lanes(v)
        plan = AttentionPlan(((n, (1, n)),), False, kernel, interpret and kernel != "xla")
        return paged_attention(q, k, v, layer, _batch(pos, seq), page_size=PAGE,
                               block_size=BLOCK, plan=plan, kv_heads=KV, terms=_terms(terms))

    return jax.jit(run)


def test_pinned_blocks_do_not_depend_on_the_step() -> None:
    # a function of the page size alone: the split is a whole number of compute blocks
    for page in (1, 4, 16, 64, 256):
        per_block, per_split = pinned_blocks(page)
        assert per_block >= 1 and per_split % per_block == 0


# the TPU kernel on the small blocks here (through the attention dispatch, the traced
# layer index); its pinned blocks are checked against the XLA formulation, float32 at
# three head layouts and bfloat16, by tests/model/test_tpu_attention.py
KERNEL_BLOCKS = [("pallas_gpu", "pinned"), ("pallas_gpu", "small"), ("pallas_tpu", "small")]


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel,blocks", KERNEL_BLOCKS, indirect=["blocks"])
def test_matches_the_xla_formulation(kernel: str, dtype: str, blocks: str, terms: str) -> None:
    """(the GPU path's terms: our kernel, attention_gpu.py; plain: JAX's)"""
    q, k, v = _pools(dtype)
    layer = jnp.int32(1)
    ref = _attend("xla", terms=terms)(q, k, v, layer, POS, SEQ)
    attend = _attend(kernel, terms=terms)  # one trace for both layers (traced layer index)
    out = attend(q, k, v, layer, POS, SEQ)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err <= TOLERANCE[(kernel, dtype)], err
    # the other layer gives other values (the layer index is honoured)
    other = attend(q, k, v, jnp.int32(0), POS, SEQ)
    assert float(jnp.max(jnp.abs(other.astype(jnp.float32) - out.astype(jnp.float32)))) > 0.1


# the TPU kernel on the small blocks only: its pinned blocks (one key block here) are
# checked bitwise at the engine's page size, several key and query blocks per step, by
# tests/model/test_tpu_attention.py (8 s of interpret mode here)
@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("kernel,blocks", KERNEL_BLOCKS, indirect=["blocks"])
def test_rows_are_batch_invariant_bitwise(kernel: str, blocks: str, terms: str) -> None:
    q, k, v = _pools("float32")
    attend = _attend(kernel, terms=terms)
    layer = jnp.int32(1)
    full = np.asarray(attend(q, k, v, layer, POS, SEQ))
    decode = np.array([0, 11])  # the decode rows
    # each decode row alone, the decode rows together, and beside the prefill (`full`)
    for i in decode:
        alone = np.asarray(attend(q[i:i + 1], k, v, layer, POS[i:i + 1], SEQ[i:i + 1]))
        np.testing.assert_array_equal(alone[0], full[i])
    both = np.asarray(attend(q[decode], k, v, layer, POS[decode], SEQ[decode]))
    np.testing.assert_array_equal(both, full[decode])
    # the prefill chunk alone, and the whole step in another order
    chunk = np.arange(1, 11)
    alone = np.asarray(attend(q[chunk], k, v, layer, POS[chunk], SEQ[chunk]))
    np.testing.assert_array_equal(alone, full[chunk])
    perm = np.random.default_rng(3).permutation(len(SEQ))
    shuffled = np.asarray(attend(q[perm], k, v, layer, POS[perm], SEQ[perm]))
    np.testing.assert_array_equal(shuffled, full[perm])


@pytest.mark.parametrize("kernel", KERNELS)
def test_tensor_parallel_kernel_matches_one_device(kernel: str) -> None:
    """Over 2 devices each Pallas kernel runs in a shard_map (attention_pallas.py), each
    device over its own KV heads of the pool (the TPU kernel's lanes, the GPU's heads):
    the rows are bitwise those of one device, plain and with a window and sinks (on the
    GPU path: JAX's kernel, then ours)."""
    split = True
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from multiserve.model.sharding import make_mesh
    from multiserve.model.tensor_parallel import TensorParallel

    q, k, v = _pools("float32")
    mesh = make_mesh(jax.devices()[:2])
    tp = TensorParallel(mesh, False, split)
    heads = NamedSharding(mesh, P(None, "tensor", None) if split else P())
    if kernel == "pallas_tpu":
        pool = NamedSharding(mesh, P(None, None, "tensor") if split else P())
        k, v = to_lanes(k, split), to_lanes(v, split)  # the TPU kernel's pool layout
    else:
        pool = NamedSharding(mesh, P(None, "tensor", None, None) if split else P())

    sinks = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape[1]), jnp.float32)

    def run(q, k, v, tp, terms):  # type: ignore[no-untyped-def]
        return attention_pallas.paged_attention_pallas(
            q, k, v, jnp.int32(1), _batch(POS, SEQ), page_size=PAGE, kernel=kernel,
            interpret=True, tp=tp, kv_heads=KV, terms=terms)

    # plain, and a traced window with sinks (each device its own heads' sinks)
    for terms in (PLAIN_ATTENTION, AttentionTerms(window=jnp.int32(6), sinks=sinks)):
        one = np.asarray(jax.jit(lambda q, k, v, t=terms: run(q, k, v, None, t))(q, k, v))
        many = jax.jit(lambda q, k, v, t=terms: run(q, k, v, tp, t))(
            jax.device_put(q, heads), jax.device_put(k, pool), jax.device_put(v, pool))
        np.testing.assert_array_equal(np.asarray(many), one)


def test_the_calibration_chooses_a_forced_pallas_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.probes import pallas_attention_kernel
    from multiserve.model.invariance.store import backend_key
    from multiserve.model.invariance.workload import AttentionUse, Workload

    use = AttentionUse(kv_heads=KV, group=GROUP, head_dim=HEAD_DIM, page_size=PAGE,
                       block_size=BLOCK, sizes=(1, 4, 8))
    workload = Workload(dtype="float32", products=(), row_sums=(), attention=use)
    device = jax.devices()[0]
    plain_key = backend_key(device, workload)
    assert pallas_attention_kernel(use, device) is None  # the CPU: none unless forced
    monkeypatch.setenv(FORCE_ENV, "pallas_gpu")
    assert pallas_attention_kernel(use, device) == ("pallas_gpu", True)
    assert backend_key(device, workload) != plain_key  # a forced plan is cached apart
    cal = calibrate(workload, device, use_cache=False)
    attention = cal.plan.attention
    assert (attention.kernel, attention.interpret, cal.plan.verified) == (
        "pallas_gpu", True, True)
    assert all(chunk == 1 and padded == t for t, (chunk, padded) in attention.by_tokens)
    # the probe's kernel rows at every size are the reference's: the candidates it made
    probe_rows = [r for r in cal.table if r["kernel"] == "pallas_gpu"]
    assert sorted(r["tokens"] for r in probe_rows) == [1, 4, 8]
    assert all(r["matches_reference"] for r in probe_rows)
    monkeypatch.setenv(FORCE_ENV, "no_such_kernel")
    with pytest.raises(ValueError, match=FORCE_ENV):
        pallas_attention_kernel(use, device)


@pytest.mark.parametrize("kernel", KERNELS)
def test_windowed_layers_take_the_pallas_kernels(monkeypatch: pytest.MonkeyPatch,
                                                 kernel: str) -> None:
    """Layers with a sliding window and a soft cap: both Pallas kernels compute them (on
    a GPU, ours: attention_gpu.py), so the calibration chooses the forced one, verified
    on every layer kind (a window layer and a global one)."""
    from multiserve.model.invariance.calibration import calibrate
    from multiserve.model.invariance.probes import pallas_attention_kernel
    from multiserve.model.invariance.workload import AttentionUse, Workload

    use = AttentionUse(kv_heads=KV, group=GROUP, head_dim=HEAD_DIM, page_size=PAGE,
                       block_size=BLOCK, sizes=(4,), kinds=((5, True),), softcap=3.0)
    device = jax.devices()[0]
    monkeypatch.setenv(FORCE_ENV, kernel)
    assert pallas_attention_kernel(use, device) == (kernel, True)
    workload = Workload(dtype="float32", products=(), row_sums=(), attention=use)
    cal = calibrate(workload, device, use_cache=False)
    assert (cal.plan.attention.kernel, cal.plan.verified) == (kernel, True), \
        cal.plan.problems


def _sims(kernel: str, windowed: bool = False):  # type: ignore[no-untyped-def]
    """Two simulators of the tiny model on the same params and page assignment: the
    default plan's attention (this CPU's), and the same plan with `kernel` interpreted.
    `windowed`: its first layer slides over 6 keys (Mistral's layer kinds: the scanned
    decoder's window a traced scalar), the scores soft-capped and scaled as Gemma 2's."""
    from dataclasses import replace

    from model_helpers import TINY_LLAMA, PagedSim

    from multiserve.model.loading.param_layout import init_random_params

    cfg = TINY_LLAMA if not windowed else replace(
        TINY_LLAMA, architecture="mistral", sliding_window=6, sliding_layers=(0,),
        attn_logit_softcapping=4.0, query_pre_attn_scalar=8.0)
    params = jax.device_put(init_random_params(cfg, seed=7, scale=0.3))
    make = lambda plan=None: PagedSim(params, cfg, page_size=PAGE, block_size=16,  # noqa: E731
                                      num_pages=64, max_pages=16, seed=1, plan=plan)
    base = make()
    sizes = (1, 2, 4, 8, 16, 32)
    plan = replace(base.plan, attention=AttentionPlan(tuple((t, (1, t)) for t in sizes),
                                                      False, kernel, True))
    return base, make(plan), cfg


# the TPU kernel on the windowed model only (its plain terms: the tests above and
# test_tpu_attention.py; its layer 1 is global, the kernel's window 0 traced); the GPU path
# on both: the plain model runs JAX's kernel, the windowed one ours (attention_gpu.py)
@pytest.mark.parametrize("kernel,windowed", [("pallas_gpu", False), ("pallas_gpu", True),
                                             ("pallas_tpu", True)])
def test_model_forward_with_pallas_attention(kernel: str, windowed: bool) -> None:
    """The whole tiny model (2 layers, scanned and unrolled decoders alike take the plan's
    attention) with the Pallas kernel: logits close to the default plan's, and a decode
    row's logits bitwise the same alone and beside a prefill chunk; the TPU kernel's model
    has a window layer beside a global one, soft-capped and scaled scores."""
    rng = np.random.default_rng(11)
    base, sim, cfg = _sims(kernel, windowed)
    tokens = {n: [int(t) for t in rng.integers(3, cfg.vocab_size, 40)] for n in "xyz"}
    got = {}
    for name, s in (("xla", base), ("pallas", sim)):
        for n, toks in tokens.items():
            s.add(n, toks)
        first = s.step([("x", 21), ("y", 9)], T=32, B=4, R=4,
                       logits_for={"x": [0, 10, 20], "y": [8]})
        if name == "pallas":
            alone = s.fork()  # the same state, for the decode row alone below
        mixed = s.step([("x", 1), ("z", 13)], T=16, B=4, R=4, logits_for={"x": [21]})
        got[name] = {**first, **mixed}
    for key, ref in got["xla"].items():
        # both kernels in float32 here: 1e-3 absolute (|logits| up to ~5, two layers)
        tol = 1e-3
        assert float(np.max(np.abs(got["pallas"][key] - ref))) <= tol, key
    # the decode row of x at position 21 again, alone, from the state before the mixed step
    solo = alone.step([("x", 1)], T=1, B=1, R=1)
    np.testing.assert_array_equal(solo[("x", 21)], got["pallas"][("x", 21)])
