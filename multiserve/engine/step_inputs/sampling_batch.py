"""Host side of the sampler: builds a NumPy `SamplingBatch` for one step.

Owns `RowSpec` (what one running sample needs for one step), `PenaltyZeros` /
`penalty_zeros` (the [R, V] penalty arrays reused while no row has a penalty) and
`build_sampling_batch`. NumPy only: no device work here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import jax
import numpy as np

from multiserve.engine.sampling.sampler import MAX_BANNED_IDS, SamplingBatch
from multiserve.types import MAX_TOKEN_IDS_LOGPROB, SamplingParams


@dataclass(frozen=True)
class RowSpec:
    """What the sampler needs to know about one running sample for one step."""

    params: SamplingParams
    seed: int  # resolved, in [0, 2**63)
    sample_index: int
    position: int  # sequence position of the token being sampled
    output_ids: Sequence[int]
    prompt_ids: Sequence[int]
    ban_ids: tuple[int, ...] = ()  # forbidden this step (eos/stop ids before min_new_tokens)
    # the grammar's packed allowed tokens (int32[mask_words(V)]); None: unconstrained
    token_mask: np.ndarray | None = field(default=None, compare=False)


class PenaltyZeros(NamedTuple):
    """Zero-filled [R, V] penalty arrays reused while no row has a penalty.

    The engine keeps one per (R, device), already on the device
    (`jax.device_put(penalty_zeros(R, V), device)`), and passes it as `zeros=` so a
    penalty-free step moves and allocates no [R, V] data."""

    output_counts: np.ndarray | jax.Array  # i32[R, V]
    prompt_mask: np.ndarray | jax.Array  # bool[R, V]


def mask_words(vocab: int) -> int:
    """int32 words of one packed token-mask row."""
    return (vocab + 31) // 32


def mask_zeros(rows: int, vocab: int) -> np.ndarray:
    """The token mask of a step with no constrained row (never read: no row is masked)."""
    return np.zeros((rows, mask_words(vocab)), np.int32)


def penalty_zeros(rows: int, vocab: int) -> PenaltyZeros:
    return PenaltyZeros(np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), np.bool_))


def build_sampling_batch(rows: Sequence[RowSpec | None], R: int, vocab: int, *,
                         max_banned: int = MAX_BANNED_IDS,
                         zeros: PenaltyZeros | None = None,
                         no_masks: np.ndarray | jax.Array | None = None) -> SamplingBatch:
    """NumPy `SamplingBatch` for `rows` padded to `R` (None = padding row, greedy).

    The [R, V] penalty arrays are filled only when some row has a penalty; otherwise they
    are `zeros` (returned as given, e.g. cached device arrays) or fresh zeros. Likewise
    the token mask is built only when some row carries one, else `no_masks` (e.g. cached
    device zeros) or fresh zeros."""
    assert len(rows) <= R, (len(rows), R)
    f32, i32 = np.float32, np.int32
    temperature = np.zeros(R, f32)
    top_k = np.zeros(R, i32)
    top_p = np.ones(R, f32)
    min_p = np.zeros(R, f32)
    freq = np.zeros(R, f32)
    pres = np.zeros(R, f32)
    rep = np.ones(R, f32)
    seed_hi = np.zeros(R, np.uint32)
    seed_lo = np.zeros(R, np.uint32)
    sample_index = np.zeros(R, i32)
    position = np.zeros(R, i32)
    banned = np.full((R, max_banned), -1, i32)
    top_n = np.zeros(R, i32)
    lp_ids = np.full((R, MAX_TOKEN_IDS_LOGPROB), -1, i32)
    # the rows present, and their params' fixed fields (SamplingParams.sampler_fields,
    # computed once per params object: only seeds, sample indexes and positions are
    # gathered from the specs every step)
    live = [i for i, row in enumerate(rows) if row is not None]
    specs = cast("list[RowSpec]", [rows[i] for i in live])
    fields = [row.params.sampler_fields for row in specs]
    penalised = [i for i, f in zip(live, fields) if f.has_penalty]
    if penalised:
        counts, prompt_mask = penalty_zeros(R, vocab)
    else:
        counts, prompt_mask = zeros if zeros is not None else penalty_zeros(R, vocab)
    assert counts.shape == (R, vocab) and prompt_mask.shape == (R, vocab)
    # one store per field of the rows present: a slice store when they are rows 0..n-1
    # (a decode step), else an index store; float32 stores round Python floats as
    # element stores do
    at: slice | list[int] = slice(0, len(live)) if len(live) == len(rows) else live
    floats = np.array([f.floats for f in fields], f32).reshape(len(fields), 6).T
    temperature[at], top_p[at], min_p[at], freq[at], pres[at], rep[at] = floats
    top_k[at] = [k if k < vocab else 0 for k in [f.top_k for f in fields]]
    top_n[at] = [f.top_logprobs_num for f in fields]
    seeds = [row.seed for row in specs]
    assert all(0 <= seed < 2**63 for seed in seeds), seeds
    seed_hi[at] = [seed >> 32 for seed in seeds]
    seed_lo[at] = [seed & 0xFFFFFFFF for seed in seeds]
    sample_index[at] = [row.sample_index for row in specs]
    position[at] = [row.position for row in specs]
    for i, row in zip(live, specs):
        if row.ban_ids:
            assert len(row.ban_ids) <= max_banned, (len(row.ban_ids), max_banned)
            banned[i, :len(row.ban_ids)] = row.ban_ids
        if row.params.token_ids_logprob is not None:
            lp_ids[i, :len(row.params.token_ids_logprob)] = row.params.token_ids_logprob
    any_logprobs = any(f.wants_logprobs for f in fields)
    for i in penalised:
        row = rows[i]
        assert row is not None
        out = np.asarray(row.output_ids, np.int64)
        counts[i] = np.bincount(out, minlength=vocab)[:vocab]
        if row.params.repetition_penalty != 1.0:
            prompt_mask[i, np.asarray(row.prompt_ids, np.int64)] = True
    masked = np.zeros(R, np.bool_)
    constrained = [i for i, row in enumerate(rows) if row is not None
                   and row.token_mask is not None]
    if constrained:
        token_mask = mask_zeros(R, vocab)
        for i in constrained:
            row = rows[i]
            assert row is not None and row.token_mask is not None
            token_mask[i] = row.token_mask
            masked[i] = True
    else:
        token_mask = no_masks if no_masks is not None else mask_zeros(R, vocab)
    assert token_mask.shape == (R, mask_words(vocab)), token_mask.shape
    sampled = temperature > 0
    return SamplingBatch(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
        seed_hi=seed_hi, seed_lo=seed_lo, sample_index=sample_index, position=position,
        output_counts=counts, unread_token=np.zeros(R, i32), has_unread=np.zeros(R, np.bool_),
        prompt_mask=prompt_mask, token_mask=token_mask, masked=masked, banned_ids=banned,
        top_logprobs_num=top_n, logprob_token_ids=lp_ids,
        any_sampled=np.bool_(sampled.any()),
        any_penalty=np.bool_(bool(penalised)),
        any_filter=np.bool_((sampled & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()),
        any_logprobs=np.bool_(any_logprobs),
        any_banned=np.bool_((banned >= 0).any()),
        any_masked=np.bool_(bool(constrained)))
