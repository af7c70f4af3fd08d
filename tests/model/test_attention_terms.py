"""Sliding windows, attention sinks and score soft caps (layers/attention_terms.py) in both
attention kernels of the CPU, the native one and the XLA formulation, and in our TPU and GPU
Pallas kernels (interpret mode; the GPU one also lowered for CUDA): each equals a float64
reference of transformers' definitions, its rows are bitwise invariant to the rest of the
step, and a window row reads no page that lies wholly before its window (those are filled
with NaN here: one read would show)."""

from __future__ import annotations

import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.model.invariance.plan import AttentionPlan
from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.attention_terms import AttentionTerms
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import to_lanes

PAGE, BLOCK = 8, 16
XLA = AttentionPlan(((1 << 20, (4, 4)),), True)  # chunks of 4 rows, shared keys
XLA_ONE = AttentionPlan(((1 << 20, (1, 1)),), False)  # one row a chunk
NATIVE = AttentionPlan(((1 << 20, (1, 1)),), False, "native")
# our TPU kernel, in Pallas interpret mode (its key blocks: 16 pages of 8 here)
TPU = AttentionPlan(((1 << 20, (1, 1)),), False, "pallas_tpu", interpret=True)
# the GPU path, interpreted: our Triton kernel for every layer with a term
# (layers/attention_gpu.py), JAX's library kernel for the plain terms
GPU = AttentionPlan(((1 << 20, (1, 1)),), False, "pallas_gpu", interpret=True)
KV, GROUP, HD, SEQS, MAX_POS = 2, 3, 32, 6, 150


@pytest.fixture(scope="module")
def case() -> dict:
    rng = np.random.default_rng(0)
    pages = -(-(MAX_POS + 1) // PAGE)
    slots = (1 + SEQS * pages) * PAGE
    table = (1 + rng.permutation(SEQS * pages)).reshape(SEQS, pages).astype(np.int32)
    seq = np.concatenate([np.arange(SEQS - 1), np.full(20, SEQS - 1)]).astype(np.int32)
    pos = np.concatenate([rng.integers(0, MAX_POS, SEQS - 1), 120 + np.arange(20)])
    return dict(k=rng.standard_normal((2, KV, slots, HD)).astype(np.float32),
                v=rng.standard_normal((2, KV, slots, HD)).astype(np.float32),
                q=rng.standard_normal((len(seq), KV * GROUP, HD)).astype(np.float32),
                table=table, seq=seq, pos=pos.astype(np.int32),
                sinks=rng.standard_normal(KV * GROUP).astype(np.float32))


_RUNS: dict[tuple[AttentionPlan, float, float, bool], Any] = {}


def _run(plan: AttentionPlan, scale: float, softcap: float, sinks: bool) -> Any:
    """The jitted attention of `plan` with these static terms (the window and the sinks'
    values are arguments): one per kind for the module, each compiled once per shape."""
    key = (plan, scale, softcap, sinks)
    if key not in _RUNS:
        def run(q, kp, vp, b, window, sink_values):  # type: ignore[no-untyped-def]
            t = AttentionTerms(window=window, sinks=sink_values if sinks else None,
                               scale=scale, softcap=softcap)
            if plan.kernel == "pallas_tpu":  # its pool layout (kv_pool.py "lanes")
                kp, vp = to_lanes(kp), to_lanes(vp)
            return paged_attention(q, kp, vp, 1, b, page_size=PAGE, block_size=BLOCK,
                                   plan=plan, terms=t, kv_heads=KV)
        _RUNS[key] = jax.jit(run)
    return _RUNS[key]


def _attend(case: dict, plan: AttentionPlan, terms: AttentionTerms, idx: np.ndarray,
            k: np.ndarray | None = None, v: np.ndarray | None = None) -> np.ndarray:
    n = len(idx)
    batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32),
                         positions=jnp.asarray(case["pos"][idx]),
                         token_seq=jnp.asarray(case["seq"][idx]),
                         out_slots=jnp.zeros(n, jnp.int32),
                         page_table=jnp.asarray(case["table"]),
                         seq_lens=jnp.zeros(SEQS, jnp.int32),
                         logit_rows=jnp.zeros(1, jnp.int32))
    run = _run(plan, terms.scale, terms.softcap, terms.sinks is not None)
    sinks = jnp.zeros(KV * GROUP) if terms.sinks is None else jnp.asarray(terms.sinks)
    return np.asarray(run(jnp.asarray(case["q"][idx]),
                          jnp.asarray(case["k"] if k is None else k),
                          jnp.asarray(case["v"] if v is None else v), batch,
                          jnp.int32(terms.window), sinks))


def _reference(case: dict, terms: AttentionTerms) -> np.ndarray:
    """transformers' eager attention in float64: scores * scale, soft cap, the sliding
    window mask (kv > q - window), the sink logit in the denominator."""
    out = np.zeros(case["q"].shape)
    for t, (s, p) in enumerate(zip(case["seq"], case["pos"], strict=True)):
        keys = np.arange(p + 1)
        if terms.windowed:
            keys = keys[keys > p - int(terms.window)]
        slots = case["table"][s][keys // PAGE] * PAGE + keys % PAGE
        for h in range(KV * GROUP):
            kh = case["k"][1, h // GROUP, slots].astype(np.float64)
            vh = case["v"][1, h // GROUP, slots].astype(np.float64)
            sc = kh @ case["q"][t, h].astype(np.float64) * terms.scale_for(HD)
            if terms.softcap > 0:
                sc = np.tanh(sc / terms.softcap) * terms.softcap
            logits = np.concatenate([sc, [terms.sinks[h]]]) if terms.sinks is not None else sc
            w = np.exp(logits - logits.max())
            w = w / w.sum()
            out[t, h] = w[:len(keys)] @ vh
    return out


TERMS = {
    "window1": lambda c: AttentionTerms(window=1),
    "window5": lambda c: AttentionTerms(window=5),
    "window37": lambda c: AttentionTerms(window=37),
    "window_over_all": lambda c: AttentionTerms(window=4096),
    "sinks": lambda c: AttentionTerms(sinks=c["sinks"]),
    "window_sinks": lambda c: AttentionTerms(window=20, sinks=c["sinks"] + 2.0),
    "softcap_scale": lambda c: AttentionTerms(softcap=0.5, scale=0.7),
    "window_softcap": lambda c: AttentionTerms(window=24, softcap=2.0),
}


def _kernels(tpu: bool = True) -> list[AttentionPlan]:
    has_cxx = shutil.which("c++") or shutil.which("g++")
    return [XLA, XLA_ONE, GPU] + ([NATIVE] if has_cxx and native_kernels.unavailable_reason()
                                  is None else []) + ([TPU] if tpu else [])


@pytest.mark.parametrize("name", sorted(TERMS))
def test_each_kernel_computes_transformers_definition(case: dict, name: str) -> None:
    terms = TERMS[name](case)
    want = _reference(case, terms)
    idx = np.arange(len(case["seq"]))
    for plan in _kernels():
        got = _attend(case, plan, terms, idx)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=plan.kernel)


@pytest.mark.parametrize("name", ["window5", "window_sinks", "window_softcap"])
def test_rows_are_bitwise_invariant_with_the_terms(case: dict, name: str) -> None:
    """A row's bits do not depend on the step's size, its place or its neighbours, whose
    windows start in other key blocks (so a chunk visits blocks before a row's window)."""
    terms = TERMS[name](case)
    n = len(case["seq"])
    rng = np.random.default_rng(3)
    # (the TPU kernel's rows with these terms: tests/model/test_tpu_attention.py)
    for plan in _kernels(tpu=False):
        full = _attend(case, plan, terms, np.arange(n))
        for size in (1, 7, n):
            for idx in (np.arange(size), np.arange(n - size, n), rng.permutation(n)[:size]):
                assert np.array_equal(_attend(case, plan, terms, idx), full[idx]), (
                    plan.kernel, plan.by_tokens, size)


def test_a_window_row_reads_no_page_before_its_window(case: dict) -> None:
    """Every page of a row's sequence that ends before the key block its window starts in
    is NaN: the native kernel and a one-row XLA chunk never read it (their outputs are
    those of the clean pool); the plain terms read it (NaN)."""
    window = 9
    for t in range(len(case["seq"])):
        s, p = case["seq"][t], case["pos"][t]
        first_block = max(0, p - window + 1) // BLOCK * BLOCK
        k, v = case["k"].copy(), case["v"].copy()
        poisoned = [int(page) for i, page in enumerate(case["table"][s])
                    if (i + 1) * PAGE <= first_block]
        for page in poisoned:
            k[:, :, page * PAGE:(page + 1) * PAGE] = np.nan
            v[:, :, page * PAGE:(page + 1) * PAGE] = np.nan
        idx = np.array([t])
        # (the TPU kernel reads whole 128-position key blocks from its window's first:
        # tests/model/test_tpu_attention.py checks it fetches no page before that block)
        for plan in _kernels(tpu=False):
            if plan is XLA:
                continue  # a 4-row chunk: padding rows at position 0 read block 0
            clean = _attend(case, plan, AttentionTerms(window=window), idx)
            got = _attend(case, plan, AttentionTerms(window=window), idx, k, v)
            assert np.array_equal(got, clean), (plan.kernel, t)
            if poisoned:
                assert np.isnan(_attend(case, plan, AttentionTerms(), idx, k, v)).any()


def test_the_gpu_kernel_lowers_for_cuda_with_every_term(case: dict) -> None:
    """Our GPU kernel (compiled, not interpreted) lowers to Triton for a CUDA device with a
    traced window, sinks, a soft cap and a scale, in float32 and bfloat16: a GPU compiles
    the program this CPU cannot run (the interpreted kernel's values: the tests above)."""
    plan = AttentionPlan(((1 << 20, (1, 1)),), False, "pallas_gpu", interpret=False)
    n = len(case["seq"])
    for dtype in (jnp.float32, jnp.bfloat16):
        def run(q, kp, vp, b, window, sinks):  # type: ignore[no-untyped-def]
            terms = AttentionTerms(window=window, sinks=sinks, scale=0.7, softcap=2.0)
            return paged_attention(q, kp, vp, 1, b, page_size=PAGE, block_size=BLOCK,
                                   plan=plan, terms=terms, kv_heads=KV)

        batch = ForwardBatch(input_ids=jnp.zeros(n, jnp.int32),
                             positions=jnp.asarray(case["pos"]),
                             token_seq=jnp.asarray(case["seq"]),
                             out_slots=jnp.zeros(n, jnp.int32),
                             page_table=jnp.asarray(case["table"]),
                             seq_lens=jnp.zeros(SEQS, jnp.int32),
                             logit_rows=jnp.zeros(1, jnp.int32))
        args = (jnp.asarray(case["q"], dtype), jnp.asarray(case["k"], dtype),
                jnp.asarray(case["v"], dtype), batch, jnp.int32(9),
                jnp.asarray(case["sinks"]))
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "multiserve_ragged_attention_gpu" in text and "__gpu$xla.gpu.triton" in text


def test_the_platforms_compiled_kernel_computes_every_term(case: dict) -> None:
    """Device-generic (tests/device_generic.py): the attention kernel this device's platform
    is offered (a GPU: our Triton kernel; a TPU: our Mosaic one; the CPU: the XLA
    formulation), compiled, equals transformers' float64 definition with a window and
    sinks, a window and a soft cap, a scale and a soft cap; its rows are bitwise those of
    the whole step alone, at the end and in another order."""
    platform = jax.devices()[0].platform
    kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")
    plan = AttentionPlan(((1 << 20, (1, 1)),), False, kernel, interpret=False)
    tolerance = 2e-5 if platform == "cpu" else 5e-3  # an accelerator's f32 products: TF32
    n = len(case["seq"])
    rng = np.random.default_rng(4)
    for name in ("window_sinks", "window_softcap", "softcap_scale"):
        terms = TERMS[name](case)
        got = _attend(case, plan, terms, np.arange(n))
        np.testing.assert_allclose(got, _reference(case, terms), rtol=tolerance,
                                   atol=tolerance, err_msg=f"{kernel} {name}")
        for idx in (np.arange(1), np.arange(n - 7, n), rng.permutation(n)[:7]):
            assert np.array_equal(_attend(case, plan, terms, idx), got[idx]), (kernel, name)
