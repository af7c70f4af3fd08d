"""The jitted sampler against NumPy references on small vocabularies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.engine.sampling.sampler import CANDIDATES, SamplingBatch, sample
from multiserve.engine.step_inputs.sampling_batch import (
    RowSpec,
    build_sampling_batch,
    penalty_zeros,
)
from multiserve.types import SamplingParams

V = 64
R = 64
_sample = jax.jit(sample)


def P(**kw: object) -> SamplingParams:  # noqa: N802
    return SamplingParams(**kw)  # type: ignore[arg-type]


def spec(params: SamplingParams, seed: int = 7, index: int = 0, position: int = 5,
         output: tuple[int, ...] = (), prompt: tuple[int, ...] = (),
         ban: tuple[int, ...] = ()) -> RowSpec:
    return RowSpec(params=params, seed=seed, sample_index=index, position=position,
                   output_ids=output, prompt_ids=prompt, ban_ids=ban)


def run(logits: np.ndarray, rows: list[RowSpec | None], r: int | None = None,
        **changes: object):
    r = logits.shape[0] if r is None else r
    sb = build_sampling_batch(rows, r, logits.shape[1])
    if changes:
        sb = sb.replace(**changes)
    return jax.device_get(_sample(jnp.asarray(logits), sb))


def random_logits(rng: np.random.Generator, r: int, v: int = V, scale: float = 2.0
                  ) -> np.ndarray:
    return (rng.normal(size=(r, v)) * scale).astype(np.float32)


# ----------------------------------------------------------------------- NumPy references

def np_penalise(x: np.ndarray, counts: np.ndarray, prompt_mask: np.ndarray,
                p: SamplingParams) -> np.ndarray:
    x = x.astype(np.float64).copy()
    seen = prompt_mask | (counts > 0)
    rp = p.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def np_filtered_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Sequential top_k -> top_p -> min_p on softmax(x / T), renormalised."""
    z = x.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, bool)
    if 0 < p.top_k < len(x):
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        csum = np.cumsum(q[order])
        n = int(np.searchsorted(csum, p.top_p * csum[-1])) + 1  # smallest prefix >= top_p
        keep[order[n:]] = False
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    q = np.where(keep, probs, 0.0)
    return q / q.sum()


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# --------------------------------------------------------------------------------- tests

def test_greedy_is_argmax_with_lowest_id_on_ties_and_never_a_banned_id() -> None:
    rng = np.random.default_rng(0)
    x = random_logits(rng, R)
    x[0, [3, 9, 40]] = 50.0  # three-way tie for the max
    x[1, :] = 1.0  # all tied
    rows: list[RowSpec | None] = [spec(P(temperature=0.0)) for _ in range(R - 4)] + [None] * 4
    out = run(x, rows)
    assert out.next_ids[0] == 3 and out.next_ids[1] == 0
    np.testing.assert_array_equal(out.next_ids[2:], np.argmax(x[2:], axis=1))
    # Ban the best two ids of every row (and the tied ones in row 0): the 3rd best wins.
    order = np.argsort(-x, axis=1, kind="stable")
    rows = [spec(P(temperature=0.0), ban=tuple(int(t) for t in order[i, :2]))
            for i in range(R)]
    rows[0] = spec(P(temperature=0.0), ban=(3, 9, 40))
    out = run(x, rows)
    np.testing.assert_array_equal(out.next_ids[2:], order[2:, 2])
    assert out.next_ids[0] not in (3, 9, 40) and out.next_ids[0] == order[0, 3]
    # top_k=1 is greedy too, and bans also hold for sampled rows over many seeds.
    rows = [spec(P(temperature=1.5), seed=s, ban=tuple(int(t) for t in order[s, :5]))
            for s in range(R)]
    out = run(x, rows)
    assert not any(out.next_ids[i] in order[i, :5] for i in range(R))
    out = run(x, [spec(P(temperature=1.0, top_k=1), seed=s) for s in range(R)])
    np.testing.assert_array_equal(out.next_ids[2:], order[2:, 0])
    # bf16 logits (many ties after rounding) are upcast; ties still go to the lowest id.
    xb = jnp.asarray(x * 0.05, jnp.bfloat16)
    out = _sample(xb, build_sampling_batch([spec(P(temperature=0.0))] * R, R, V))
    np.testing.assert_array_equal(out.next_ids, np.argmax(np.asarray(xb, np.float32), axis=1))


@pytest.mark.parametrize("params", [
    P(temperature=0.0, repetition_penalty=1.7),
    P(temperature=0.0, repetition_penalty=0.6),
    P(temperature=0.0, frequency_penalty=1.3),
    P(temperature=0.0, presence_penalty=-1.5),
    P(temperature=0.0, frequency_penalty=-0.7, presence_penalty=1.9, repetition_penalty=1.3),
])
def test_each_penalty_matches_numpy_and_only_touches_rows_that_ask(
        params: SamplingParams) -> None:
    rng = np.random.default_rng(1)
    x = random_logits(rng, R, scale=1.0)
    outputs = [tuple(int(t) for t in rng.integers(0, V, rng.integers(0, 30))) for _ in range(R)]
    prompts = [tuple(int(t) for t in rng.integers(0, V, rng.integers(1, 20))) for _ in range(R)]
    asks = np.arange(R) % 2 == 0
    rows = [spec(params if asks[i] else P(temperature=0.0), output=outputs[i],
                 prompt=prompts[i]) for i in range(R)]
    sb = build_sampling_batch(rows, R, V)
    # Fill counts for the rows that do not ask too: their logits must stay untouched.
    counts = np.stack([np.bincount(o, minlength=V) for o in outputs]).astype(np.int32)
    mask = np.zeros((R, V), bool)
    for i, pr in enumerate(prompts):
        mask[i, list(pr)] = True
    np.testing.assert_array_equal(np.asarray(sb.output_counts)[asks], counts[asks])
    out = run(x, rows, output_counts=counts, prompt_mask=mask)
    want = [np.argmax(np_penalise(x[i], counts[i], mask[i], params)) if asks[i]
            else np.argmax(x[i]) for i in range(R)]
    np.testing.assert_array_equal(out.next_ids, want)
    assert (out.next_ids[asks] != np.argmax(x[asks], axis=1)).sum() >= 3  # penalties bite


def _draws(x_row: np.ndarray, params: SamplingParams, n: int, seed: int = 11,
           counts: np.ndarray | None = None) -> np.ndarray:
    """n draws for one logits row: n rows that differ only in position."""
    x = np.broadcast_to(x_row, (n, x_row.shape[0])).copy()
    rows: list[RowSpec | None] = [spec(params, seed=seed, position=i) for i in range(n)]
    changes = {}
    if counts is not None:
        changes["output_counts"] = np.broadcast_to(counts, x.shape).astype(np.int32)
        rows = [spec(params, seed=seed, position=i, output=(0,)) for i in range(n)]
    return run(x, rows, **changes).next_ids


FILTERS = [
    P(temperature=0.5),
    P(temperature=2.5),
    P(temperature=1.0, top_k=9),
    P(temperature=1.3, top_p=0.6),
    P(temperature=1.0, min_p=0.08),
    P(temperature=0.8, top_k=20, top_p=0.8, min_p=0.02),
    P(temperature=1.0, top_p=0.7, frequency_penalty=0.9),
]


@pytest.mark.parametrize("params", FILTERS)
def test_filtered_sampling_matches_the_reference_distribution(params: SamplingParams) -> None:
    rng = np.random.default_rng(2)
    x_row = random_logits(rng, 1, scale=1.5)[0]
    counts = None
    ref_x = x_row
    if params.frequency_penalty:
        counts = rng.integers(0, 3, V)
        ref_x = np_penalise(x_row, counts, np.zeros(V, bool), params)
    want = np_filtered_probs(ref_x, params)
    n = 20000
    got = _draws(x_row, params, n, counts=counts)
    freq = np.bincount(got, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))  # never outside the set
    assert (freq[want * n >= 15] > 0).all()  # and no likely token missing
    tv = 0.5 * np.abs(freq - want).sum()
    support = want > 0
    chi2 = n * (((freq - want)[support] ** 2) / want[support]).sum()
    df = support.sum() - 1
    assert tv < 0.04, tv
    assert chi2 < df + 5 * np.sqrt(2 * df), (chi2, df)  # p < ~1e-5


@pytest.mark.parametrize("params", [
    P(temperature=1.0, top_p=0.5),  # nucleus far beyond CANDIDATES: exact bisection path
    P(temperature=1.0, top_k=CANDIDATES + 150),
    P(temperature=1.0, top_k=CANDIDATES + 300, top_p=0.7),
])
def test_deep_cut_offs_past_the_candidate_window_are_exact(params: SamplingParams) -> None:
    v = 1000
    rng = np.random.default_rng(3)
    x_row = random_logits(rng, 1, v=v, scale=0.4)[0]
    want = np_filtered_probs(x_row, params)
    allowed = set(np.flatnonzero(want))
    assert len(allowed) > CANDIDATES
    seen: set[int] = set()
    for seed in range(5):
        seen |= set(_draws(x_row, params, 4000, seed=seed).tolist())
    assert seen == allowed  # nothing outside the set, and every allowed token drawn


def test_deep_rows_draw_the_same_whatever_batch_they_share() -> None:
    v, n = 1000, 4000  # the shape of the test above: no extra compile
    rng = np.random.default_rng(7)
    x = random_logits(rng, n, v=v, scale=0.4)
    deep = [P(temperature=1.0, top_p=0.6), P(temperature=1.0, top_k=CANDIDATES + 40),
            P(temperature=1.2, top_k=CANDIDATES + 100, top_p=0.8, min_p=0.3)]
    rows = [spec(deep[i % 3] if i % 4 else P(temperature=1.0, top_k=3), seed=i, position=i)
            for i in range(n)]
    a = run(x, rows).next_ids  # type: ignore[arg-type]
    # Same rows, shuffled among other neighbours (so in other bisection groups).
    perm = rng.permutation(n)[: n // 2]
    xb = random_logits(rng, n, v=v, scale=0.4)
    rows_b: list[RowSpec | None] = [spec(P(temperature=1.0, top_p=0.5), seed=7, position=i)
                                    for i in range(n)]
    slots = rng.permutation(n)[: n // 2]
    for i, slot in zip(perm, slots):
        rows_b[slot] = rows[i]
        xb[slot] = x[i]
    b = run(xb, rows_b).next_ids
    np.testing.assert_array_equal(a[perm], b[slots])


def test_draws_depend_only_on_seed_sample_index_and_position() -> None:
    rng = np.random.default_rng(4)
    x = random_logits(rng, 128, scale=0.5)
    params = P(temperature=1.0, top_p=0.95)
    mine = [spec(params, seed=2**40 + i, index=i % 3, position=100 + i) for i in range(16)]
    # Batch A: my 16 rows first, rest padding, R=64.
    a = run(x[:64], mine + [None] * 48).next_ids[:16]
    # Batch B: R=128, my rows scattered among rows with other params (flags all on).
    perm = rng.permutation(128)[:16]
    others = [spec(P(temperature=0.9, top_k=5, repetition_penalty=1.2, return_logprob=True,
                     top_logprobs_num=3), seed=99, position=i, output=(1, 2),
                   ban=(4,)) for i in range(128)]
    xb = random_logits(rng, 128)
    for j, row in enumerate(perm):
        others[row] = mine[j]
        xb[row] = x[j]
    b = run(xb, others).next_ids[perm]  # type: ignore[arg-type]
    np.testing.assert_array_equal(a, b)
    # Different positions, sample indexes or seeds give (statistically) different draws.
    base = _draws(x[0], params, 128, seed=5)
    by_index = run(np.broadcast_to(x[0], (128, V)).copy(),
                   [spec(params, seed=5, index=1, position=i) for i in range(128)]).next_ids
    by_seed = _draws(x[0], params, 128, seed=5 + 2**32)  # differs in the high word only
    assert len(set(base.tolist())) > 20
    assert (base == by_index).mean() < 0.2 and (base == by_seed).mean() < 0.2
    assert (base[1:] == base[:-1]).mean() < 0.2


def test_row_keys_are_threefry_of_index_and_position_under_the_seed() -> None:
    """The documented key derivation (seeded outputs stay stable across releases)."""
    from jax.extend.random import threefry_2x32

    from multiserve.engine.sampling.sampler import _row_words

    cases = [(0, 0, 0), (2**62 + 12345, 3, 777), (2**40, 63, 10**6)]
    sb = build_sampling_batch([spec(P(), seed=s, index=i, position=p) for s, i, p in cases],
                              3, V)
    want = [threefry_2x32(jnp.array([s >> 32, s & 0xFFFFFFFF], jnp.uint32),
                          jnp.array([i, p], jnp.uint32)) for s, i, p in cases]
    np.testing.assert_array_equal(jax.jit(_row_words)(sb), np.stack(want))


def test_logprobs_are_the_raw_log_softmax() -> None:
    rng = np.random.default_rng(5)
    x = random_logits(rng, R, scale=3.0)
    ids = tuple(int(t) for t in rng.integers(0, V, 7))
    params = P(temperature=0.8, top_k=10, repetition_penalty=1.5, presence_penalty=1.0,
               return_logprob=True, top_logprobs_num=20, token_ids_logprob=ids)
    rows = [spec(params, seed=i, output=(1, 2, 3), ban=(5,)) for i in range(R - 1)] + [None]
    out = run(x, rows)
    lp = np_log_softmax(x)
    np.testing.assert_allclose(out.logprob, lp[np.arange(R), out.next_ids], atol=1e-5)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lp, order, 1), atol=1e-5)
    np.testing.assert_allclose(out.selected_logprobs[:-1, :7], lp[:-1][:, list(ids)], atol=1e-5)
    assert np.isneginf(out.selected_logprobs[:-1, 7:]).all()


def test_compiles_once_per_shape_whatever_the_parameters() -> None:
    traces = []

    def counted(logits: jax.Array, sb: SamplingBatch):  # a new function: its own jit cache
        traces.append(1)
        return sample(logits, sb)

    f = jax.jit(counted)
    rng = np.random.default_rng(6)
    x = jnp.asarray(random_logits(rng, R))
    zeros = penalty_zeros(R, V)
    variants = [P(temperature=0.0), P(temperature=1.0), P(temperature=0.5, top_p=0.3),
                P(temperature=0.0, frequency_penalty=0.5, return_logprob=True),
                P(temperature=2.0, top_k=3, min_p=0.1, top_logprobs_num=4,
                  token_ids_logprob=(1, 2))]
    for i, params in enumerate(variants):
        rows = [spec(params, seed=i, output=(3,), ban=(1,) if i % 2 else ())] * (R - i)
        sb = build_sampling_batch(rows, R, V, zeros=zeros)
        assert isinstance(sb, SamplingBatch)
        jax.block_until_ready(f(x, sb))
    assert len(traces) == 1 and f._cache_size() == 1


def test_build_sampling_batch_pads_flags_and_reuses_zeros() -> None:
    zeros = penalty_zeros(8, V)
    rows = [spec(P(temperature=0.5, top_k=V + 5), seed=2**62 + 3, index=2, position=9),
            None, spec(P(temperature=1.0, top_k=1)), spec(P(temperature=0.0, top_p=0.5))]
    sb = build_sampling_batch(rows, 8, V, zeros=zeros)
    assert sb.output_counts is zeros.output_counts and sb.prompt_mask is zeros.prompt_mask
    np.testing.assert_array_equal(sb.temperature, [0.5, 0, 0, 0, 0, 0, 0, 0])
    assert sb.top_k[0] == 0 and sb.top_p[3] == 1.0  # clamped / greedy rows unfiltered
    assert (int(sb.seed_hi[0]) << 32) | int(sb.seed_lo[0]) == 2**62 + 3
    assert sb.sample_index[0] == 2 and sb.position[0] == 9
    assert bool(sb.any_sampled) and not bool(sb.any_filter) and not bool(sb.any_penalty)
    assert not bool(sb.any_logprobs) and not bool(sb.any_banned)
    rows.append(spec(P(temperature=0.0, presence_penalty=1.0, min_new_tokens=2,
                       max_new_tokens=4, top_logprobs_num=2), output=(4, 4, 6),
                     prompt=(1,), ban=(0, 2)))
    sb = build_sampling_batch(rows, 8, V, zeros=zeros)
    assert sb.output_counts is not zeros.output_counts and not zeros.output_counts.any()
    assert sb.output_counts[4, 4] == 2 and sb.output_counts[4, 6] == 1
    assert not sb.prompt_mask.any()  # only repetition penalty looks at the prompt
    assert bool(sb.any_penalty) and bool(sb.any_logprobs) and bool(sb.any_banned)
    np.testing.assert_array_equal(sb.banned_ids[4, :3], [0, 2, -1])


_LOWER_SAMPLER = """
import hashlib, jax, numpy as np
from multiserve.engine.step_inputs.sampling_batch import build_sampling_batch
from multiserve.engine.sampling.sampler import sample
sb = build_sampling_batch([], 16, 512)
text = jax.jit(sample).lower(np.zeros((16, 512), np.float32), sb).as_text(debug_info=False)
print(hashlib.sha256(text.encode()).hexdigest())
"""


def test_the_sampler_lowers_to_the_same_program_in_every_process() -> None:
    """The lowered sampler (hence its persistent-cache key) must not depend on the process's
    string hash seed, or every process compiles its sampler programs (and the fused steps
    that hold them) again instead of loading them."""
    import os
    import subprocess
    import sys

    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", _LOWER_SAMPLER], env=env, check=True,
                             capture_output=True, text=True, timeout=300)
        digests.add(out.stdout.split()[-1])
    assert len(digests) == 1, digests
