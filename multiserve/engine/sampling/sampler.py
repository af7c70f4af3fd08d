"""The on-device token sampler.

Owns: `SamplingBatch` (per-row sampling state), `SampleOutput` and `sample` (pure jax,
traced inside the runner's jitted step). The host side that fills a SamplingBatch
(`RowSpec`, `PenaltyZeros`, `build_sampling_batch`) is engine/step_inputs/sampling_batch.py.

Per row, in this order: raw logits -> repetition penalty (tokens in prompt or output),
frequency and presence penalties (output counts) -> banned ids set to -inf -> tokens a
row's grammar forbids set to -inf (constrained rows only: `masked`) -> greedy rows
(temperature 0) take the argmax, ties to the lowest id; sampled rows divide by the
temperature, keep top_k, then top_p (smallest nucleus of the renormalised top_k set whose
mass reaches top_p; the best token always stays), then min_p (prob >= min_p * max prob),
and draw by Gumbel-max. Logprobs describe the RAW distribution (log_softmax of the logits
as given, before penalties, bans, grammar masks, temperature and filters).

Grammar masks: `token_mask` i32[R, ceil(V/32)] packs one bit per token (bit t % 32 of word
t // 32 set = allowed); it is read only for rows whose `masked` flag is set, so an
unconstrained row is never touched whatever its words hold (the engine passes cached
device zeros while no row is constrained: no new shape, no transfer).

Invariants:
- A row's outputs depend only on that row's inputs, never on R, its row index or other
  rows. Its noise is a function of (seed, sample_index, position, token id) only: two
  words Threefry-2x32((sample_index, position), key=(seed_hi, seed_lo)) key a counter-based
  integer hash over token ids (threefry over all R*V values costs far more than the hash:
  docs/performance.md §8).
- The scalar `any_*` flags only skip work: setting one when no row needs that work changes
  no output, except that the logprob fields are zeros while `any_logprobs` is False.
- No Python branching on values and no module-level device arrays: `sample` compiles
  once per (R, V, S) shape.
- Filters are cut-offs on the temperature-scaled logits, so tokens tied with the cut-off
  value are all kept (on exact ties top_k can keep more than k tokens).
- top_k/top_p cut-offs come from the best `CANDIDATES` logits of each row; a row whose
  cut-off lies deeper (top_k > CANDIDATES, or a flat nucleus) gets an exact bisection over
  the bits of p = exp(z - max z), run `DEEP_GROUP` rows at a time and only for the rows
  that need it (there, tokens whose p ties the cut-off's are kept too, including p that
  underflows to 0, i.e. > 87 nats below the best token: such tokens can never win the
  Gumbel-max draw). Sorting the vocabulary on XLA:CPU would cost more than the rest of
  the step, so nothing sorts it. Nuclei deeper than CANDIDATES are common at high
  temperature (docs/performance.md §8).
- The [R, V] arrays are read in fused passes; the only [R, V] buffers written are the
  penalised logits (when a row has penalties or bans) and the scaled logits that feed
  `lax.top_k` (when a row filters). On the greedy path no lax.cond branch returns an [R, V]
  operand unchanged (XLA would copy it); a sampled step always runs `_edited`, whose
  penalty cond copies the logits when no row has penalties (small beside the draw's passes,
  and the draw is traced, hence compiled, once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from multiserve.types import (
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

ROW_CHUNK = 8  # rows sampled together: every [R, V] reduction runs on [ROW_CHUNK, V]
CANDIDATES = 256  # per-row top logits examined before falling back to bisection
DEEP_GROUP = 8  # rows per bisection pass when some rows' cut-off lies past the candidates
MAX_BANNED_IDS = MAX_STOP_TOKEN_IDS + 8  # stop ids + eos ids banned before min_new_tokens
_NEG_INF = float("-inf")


@flax.struct.dataclass
class SamplingBatch:
    """One row per logits row (R rows). Built on the host by `build_sampling_batch`."""

    temperature: jax.Array  # f32[R]; 0 => greedy
    top_k: jax.Array  # i32[R]; <= 0 or >= V => disabled
    top_p: jax.Array  # f32[R]; 1.0 => disabled
    min_p: jax.Array  # f32[R]; 0.0 => disabled
    frequency_penalty: jax.Array  # f32[R]
    presence_penalty: jax.Array  # f32[R]
    repetition_penalty: jax.Array  # f32[R]; 1.0 => disabled
    seed_hi: jax.Array  # u32[R]; seed = (hi << 32) | lo
    seed_lo: jax.Array  # u32[R]
    sample_index: jax.Array  # i32[R]
    position: jax.Array  # i32[R]; sequence position of the token being sampled
    output_counts: jax.Array  # i32[R, V]; occurrences of each token in the output so far
    # The row's last output token when the host has not read it yet (overlap scheduling:
    # its id only exists on device): counted with output_counts by the penalties, which
    # are the only readers of the counts. Set on device by the runner; the host leaves 0.
    unread_token: jax.Array  # i32[R]
    has_unread: jax.Array  # bool[R]
    prompt_mask: jax.Array  # bool[R, V]; token occurs in the prompt
    token_mask: jax.Array  # i32[R, ceil(V/32)]; packed allowed tokens of masked rows
    masked: jax.Array  # bool[R]; the row is grammar-constrained (token_mask applies)
    banned_ids: jax.Array  # i32[R, S]; forbidden this step, -1 = none
    top_logprobs_num: jax.Array  # i32[R]; 0..MAX_TOP_LOGPROBS
    logprob_token_ids: jax.Array  # i32[R, MAX_TOKEN_IDS_LOGPROB]; -1 = none
    any_sampled: jax.Array  # bool[]: some row has temperature > 0
    any_penalty: jax.Array  # bool[]: some row has a penalty
    any_filter: jax.Array  # bool[]: some sampled row has top_k / top_p / min_p
    any_logprobs: jax.Array  # bool[]: some row wants any kind of logprob
    any_banned: jax.Array  # bool[]: some row bans ids
    any_masked: jax.Array  # bool[]: some row is grammar-constrained


@flax.struct.dataclass
class SampleOutput:
    next_ids: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R]; raw logprob of next_ids
    top_ids: jax.Array  # i32[R, MAX_TOP_LOGPROBS], best first
    top_logprobs: jax.Array  # f32[R, MAX_TOP_LOGPROBS], raw
    selected_logprobs: jax.Array  # f32[R, MAX_TOKEN_IDS_LOGPROB]; -inf where id is not in [0, V)


# ----------------------------------------------------------------------------- device side


def _first_argmax(x: jax.Array, fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None
                  ) -> jax.Array:
    """Per row, the id t maximising fn(x[:, t], t) (default x itself), ties to the lowest id.

    `fn` must be elementwise (per-row parameters broadcast as [R, 1, 1]). The vocabulary is
    cut into chunks: one fused pass takes each chunk's max, then only the winning chunk
    is recomputed and searched. No [R, V] intermediate is materialised: on XLA:CPU this is
    much cheaper than a two-pass where/max or jnp.argmax (docs/performance.md §8)."""
    fn = fn or (lambda xv, _: xv)
    r, v = x.shape
    c = next((c for c in (256, 128, 64, 32) if v % c == 0), 256)
    if v % c:
        x = jnp.pad(x, ((0, 0), (0, -v % c)), constant_values=_NEG_INF)
    xc = x.reshape(r, -1, c)
    nc = xc.shape[1]
    ids = (lax.broadcasted_iota(jnp.int32, (1, nc, c), 1) * c
           + lax.broadcasted_iota(jnp.int32, (1, nc, c), 2))
    # The barrier stops XLA from fusing (recomputing) this pass into each consumer below.
    chunk_max = lax.optimization_barrier(jnp.max(fn(xc, ids), axis=2))  # [R, nc]
    best = _first_max_index(chunk_max)  # [R]
    in_chunk = jnp.take_along_axis(xc, best[:, None, None], axis=1)  # [R, 1, c]
    chunk_ids = best[:, None, None] * c + lax.broadcasted_iota(jnp.int32, (1, 1, c), 2)
    return jnp.minimum(best * c + _first_max_index(fn(in_chunk, chunk_ids)[:, 0]), v - 1)


def _first_max_index(y: jax.Array) -> jax.Array:
    """i32[R]: first index of the row max of a small [R, n] array (NaN rows -> n - 1)."""
    n = y.shape[1]
    m = jnp.max(y, axis=1, keepdims=True)
    neg = -lax.broadcasted_iota(jnp.float32, y.shape, 1)
    return jnp.clip(-jnp.max(jnp.where(y == m, neg, _NEG_INF), axis=1), 0, n - 1).astype(jnp.int32)


def _apply_penalties(x: jax.Array, sb: SamplingBatch) -> jax.Array:
    ids = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    unread = sb.has_unread[:, None] & (ids == sb.unread_token[:, None])
    counts = sb.output_counts + unread.astype(sb.output_counts.dtype)
    in_output = counts > 0
    rp = sb.repetition_penalty[:, None]
    x = jnp.where(sb.prompt_mask | in_output, jnp.where(x > 0, x / rp, x * rp), x)
    x = x - sb.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return x - sb.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _apply_bans(x: jax.Array, banned: jax.Array) -> jax.Array:
    _r, v = x.shape
    ids = jnp.where((banned >= 0) & (banned < v), banned, v)  # out of range => dropped
    rows = lax.broadcasted_iota(jnp.int32, banned.shape, 0)
    return x.at[rows, ids].set(_NEG_INF, mode="drop")


def _apply_mask(x: jax.Array, token_mask: jax.Array, masked: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in a masked row's packed mask set to -inf (one fused pass:
    the bits are unpacked on the fly, never stored as an [R, V] array)."""
    r, v = x.shape
    shifts = lax.broadcasted_iota(jnp.int32, (1, 1, 32), 2)
    bits = ((token_mask[:, :, None] >> shifts) & 1).reshape(r, -1)[:, :v]
    return jnp.where(masked[:, None] & (bits == 0), _NEG_INF, x)


def _fmix32(h: jax.Array) -> jax.Array:
    """A bijective 32-bit avalanche mix (xor-shift / multiply rounds)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds (Random123), on u32 arrays: the same values as
    `jax.extend.random.threefry_2x32`, but much cheaper to compile on XLA:CPU
    (docs/performance.md §8)."""

    def rotl(x: jax.Array, r: int) -> jax.Array:
        return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))

    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for g in range(5):
        for r in _ROTATIONS[g % 2]:
            x0 = x0 + x1
            x1 = rotl(x1, r) ^ x0
        x0, x1 = x0 + ks[(g + 1) % 3], x1 + ks[(g + 2) % 3] + jnp.uint32(g + 1)
    return x0, x1


def _row_words(sb: SamplingBatch) -> jax.Array:
    """u32[R, 2]: Threefry of (sample_index, position) under the key (seed_hi, seed_lo)."""
    u32 = jnp.uint32
    w0, w1 = _threefry2x32(sb.seed_hi.astype(u32), sb.seed_lo.astype(u32),
                           sb.sample_index.astype(u32), sb.position.astype(u32))
    return jnp.stack([w0, w1], axis=1)


def _gumbel(words: jax.Array, ids: jax.Array) -> jax.Array:
    """Standard Gumbel noise for token `ids`; depends on the row's key words and the id only.
    words: u32[R, 2] broadcast against ids as [R, 1, 1]."""
    h = _fmix32(ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + words[:, :1, None])
    h = _fmix32(h ^ words[:, 1:, None])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(u))


def _bisect(pred, lo: jax.Array, hi: jax.Array, steps: int) -> jax.Array:
    """Per row, the largest i32 t in [lo, hi) with pred(t): pred monotone decreasing,
    true at lo, false at hi, and 2**steps >= hi - lo."""

    def body(_: int, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return lax.fori_loop(0, steps, body, (lo, hi))[0]


def _exact_cutoffs(z: jax.Array, zmax: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   need_k: jax.Array, thr_k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact top_k (rows in need_k) then top_p cut-offs, z-space, for a few rows [g, V].

    Both are bisections over the bit patterns of p = exp(z - zmax) in [0, 1] (for p >= 0
    they order like p), so each step reads one [g, V] array. Stage 0 counts tokens
    (top_k), stage 1 weighs them by p inside the top_k set (top_p); one compiled loop."""
    g, _ = z.shape
    p = jnp.exp(z - zmax[:, None])
    one = int(np.float32(1.0).view(np.int32))

    def stage(s: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        thr_k, thr_p = c
        count = s == 0
        w = jnp.where(count, 1.0, jnp.where(z >= thr_k[:, None], p, 0.0))
        target = jnp.where(count, top_k.astype(jnp.float32), top_p * jnp.sum(w, axis=1))

        def enough(t: jax.Array) -> jax.Array:
            cut = lax.bitcast_convert_type(t, jnp.float32)[:, None]
            return jnp.sum(jnp.where(p >= cut, w, 0.0), axis=1) >= target

        bits = _bisect(enough, jnp.zeros((g,), jnp.int32), jnp.full((g,), one + 1, jnp.int32),
                       30)
        kept = (p >= lax.bitcast_convert_type(bits, jnp.float32)[:, None]) & (w > 0)
        thr = jnp.min(jnp.where(kept, z, jnp.inf), axis=1)
        return jnp.where(count & need_k, thr, thr_k), jnp.where(count, thr_p, thr)

    return lax.fori_loop(jnp.where(jnp.any(need_k), 0, 1), 2, stage, (thr_k, thr_k))


def _deep_rows(z: jax.Array, zmax: jax.Array, sb: SamplingBatch, need_k: jax.Array,
               need: jax.Array, thr_k: jax.Array, thr_p: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Replace the cut-offs of the rows in `need` with exact ones, `DEEP_GROUP` rows at a
    time (cost scales with how many rows need it, not with R). `thr_k` is -inf where
    top_k is off. A row's result never depends on which group it lands in."""
    r, _ = z.shape
    g = min(r, DEEP_GROUP)
    # Needing rows first, then row 0 as filler: redoing any row rewrites the same values.
    order = jnp.nonzero(need, size=r + g, fill_value=0)[0].astype(jnp.int32)
    groups = (jnp.sum(need) + g - 1) // g

    def body(i: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        thr_k, thr_p = c
        rows = lax.dynamic_slice(order, (i * g,), (g,))
        k, p = _exact_cutoffs(z[rows], zmax[rows], sb.top_k[rows], sb.top_p[rows],
                              need_k[rows], thr_k[rows])
        return thr_k.at[rows].set(k), thr_p.at[rows].set(jnp.where(need[rows], p, thr_p[rows]))

    return lax.fori_loop(0, groups, body, (thr_k, thr_p))


def _keep_threshold(z: jax.Array, sb: SamplingBatch) -> jax.Array:
    """f32[R]: keep token t of a row iff z[t] >= the row's threshold (-inf = no filter)."""
    _r, v = z.shape
    kc = min(v, CANDIDATES)
    vals, _ = lax.top_k(z, kc)  # [R, kc], best first
    # Never slice `vals`: XLA:CPU then lowers top_k as a full sort (docs/performance.md §8).
    zmax = jnp.max(z, axis=1)
    k_on = (sb.top_k > 0) & (sb.top_k < v)
    k_idx = jnp.clip(sb.top_k, 1, kc) - 1
    k_in = sb.top_k <= kc
    thr_k = jnp.take_along_axis(vals, k_idx[:, None], axis=1)[:, 0]
    csum = jnp.cumsum(jnp.exp(vals - zmax[:, None]), axis=1)
    total = jnp.sum(jnp.exp(z - zmax[:, None]), axis=1)
    mass = jnp.where(k_on, jnp.take_along_axis(csum, k_idx[:, None], axis=1)[:, 0], total)
    p_on = sb.top_p < 1.0
    reached = csum >= (sb.top_p * mass)[:, None]
    first = jnp.min(jnp.where(reached, lax.broadcasted_iota(jnp.int32, csum.shape, 1), kc), axis=1)
    thr_p = jnp.take_along_axis(vals, jnp.minimum(first, kc - 1)[:, None], axis=1)[:, 0]
    need_k = k_on & ~k_in
    need_p = p_on & (need_k | (first >= kc))

    thr_k = jnp.where(k_on, thr_k, _NEG_INF)
    thr_k, thr_p = lax.cond(jnp.any(need_p | need_k), _deep_rows, lambda *a: (a[-2], a[-1]),
                            z, zmax, sb, need_k, need_p | need_k, thr_k, thr_p)
    thr_m = zmax + jnp.log(jnp.maximum(sb.min_p, 1e-38))
    thr = jnp.maximum(thr_k, jnp.where(p_on, thr_p, _NEG_INF))
    return jnp.maximum(thr, jnp.where(sb.min_p > 0, thr_m, _NEG_INF))


def _draw(x: jax.Array, sb: SamplingBatch, words: jax.Array) -> jax.Array:
    """Next ids from the (penalised) logits `x`: greedy rows argmax, sampled rows
    Gumbel-max over their filtered, temperature-scaled logits."""
    t = jnp.where(sb.temperature > 0, sb.temperature, 1.0)
    # The cond yields only per-row thresholds, so the no-filter case moves no [R, V] data.
    # Both here and in `noisy`, z is computed as x / t: the cut-off compares equal values.
    thr = lax.cond(sb.any_filter, lambda: _keep_threshold(x / t[:, None], sb),
                   lambda: jnp.full(t.shape, _NEG_INF))

    def noisy(xv: jax.Array, ids: jax.Array) -> jax.Array:  # fused; recomputed per chunk
        zv = xv / t[:, None, None]
        return jnp.where(zv >= thr[:, None, None], zv, _NEG_INF) + _gumbel(words, ids)

    return jnp.where(sb.temperature > 0, _first_argmax(x, noisy), _first_argmax(x))


def _logprobs(raw: jax.Array, next_ids: jax.Array, sb: SamplingBatch
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw log-softmax values at the wanted ids (never materialises [R, V] logprobs)."""
    r, v = raw.shape
    m = jnp.max(raw, axis=1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(raw - m), axis=1, keepdims=True))  # [R, 1]
    logprob = jnp.take_along_axis(raw, next_ids[:, None], axis=1)[:, 0] - lse[:, 0]
    kt = min(v, MAX_TOP_LOGPROBS)

    def top() -> tuple[jax.Array, jax.Array]:
        vals, ids = lax.top_k(raw, kt)
        pad = MAX_TOP_LOGPROBS - kt
        return (jnp.pad(ids, ((0, 0), (0, pad))),
                jnp.pad(vals - lse, ((0, 0), (0, pad)), constant_values=_NEG_INF))

    top_ids, top_lp = lax.cond(
        jnp.any(sb.top_logprobs_num > 0), top,
        lambda: (jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.int32),
                 jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.float32)))
    ids = sb.logprob_token_ids
    valid = (ids >= 0) & (ids < v)
    sel = jnp.take_along_axis(raw, jnp.clip(ids, 0, v - 1), axis=1) - lse
    return logprob, top_ids, top_lp, jnp.where(valid, sel, _NEG_INF)


def _edited(raw: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Penalised logits with banned ids and grammar-forbidden tokens at -inf: one new
    [R, V] buffer, banned in place."""
    x = lax.cond(sb.any_penalty, _apply_penalties, lambda x, _: x, raw, sb)
    return _apply_mask(_apply_bans(x, sb.banned_ids), sb.token_mask, sb.masked)


def sample(logits: jax.Array, sb: SamplingBatch) -> SampleOutput:
    """Next token (and raw logprobs) for every row of `logits` (f32/bf16[R, V]), R a
    multiple of ROW_CHUNK.

    Rows are sampled ROW_CHUNK at a time (`lax.map`), so every reduction over the
    vocabulary runs on one [ROW_CHUNK, V] shape whatever R: XLA:CPU's sums change their
    order with the operand's size (model/invariance/primitives.py), and a row's logprobs and
    draws must not depend on how many rows share its step. The scalar `any_*` flags stay batch-wide
    (they only skip work)."""
    r, v = logits.shape
    assert r % ROW_CHUNK == 0, (r, ROW_CHUNK)
    n = r // ROW_CHUNK
    # in field order (a set's order follows the process's string hash seed: the lowered
    # program, and so its persistent-cache key, would differ from process to process)
    names = [f.name for f in dataclasses.fields(sb)]
    per_row = [name for name in names
               if getattr(sb, name).ndim >= 1 and getattr(sb, name).shape[0] == r]
    flags = {name: getattr(sb, name) for name in names if name not in per_row}
    chunks = {name: getattr(sb, name).reshape(n, ROW_CHUNK, *getattr(sb, name).shape[1:])
              for name in per_row}

    def one(args: tuple[jax.Array, dict[str, jax.Array]]) -> SampleOutput:
        lg, rows = args
        return _sample_chunk(lg, SamplingBatch(**rows, **flags))

    out = lax.map(one, (logits.reshape(n, ROW_CHUNK, v), chunks))
    return jax.tree.map(lambda a: a.reshape(r, *a.shape[2:]), out)


def _sample_chunk(logits: jax.Array, sb: SamplingBatch) -> SampleOutput:
    """`sample` for one chunk of ROW_CHUNK rows."""
    raw = logits.astype(jnp.float32)
    r, _ = raw.shape
    edit = sb.any_penalty | sb.any_banned | sb.any_masked

    # Branches read `raw` directly where they can: an identity branch of lax.cond copies
    # the [R, V] logits, which costs about as much as the greedy argmax itself.
    def greedy_only() -> jax.Array:
        return lax.cond(edit, lambda: _first_argmax(_edited(raw, sb)),
                        lambda: _first_argmax(raw))

    def mixed() -> jax.Array:
        # One traced draw (a cond over edited / raw logits would compile it twice:
        # docs/performance.md §8); unedited logits pass through `_edited` unchanged, for
        # about one [R, V] copy beside the draw's passes.
        return _draw(_edited(raw, sb), sb, _row_words(sb))

    next_ids = lax.cond(sb.any_sampled, mixed, greedy_only)
    nt = sb.logprob_token_ids.shape[1]
    logprob, top_ids, top_lp, sel = lax.cond(
        sb.any_logprobs, lambda: _logprobs(raw, next_ids, sb),
        lambda: (jnp.zeros((r,), jnp.float32), jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.int32),
                 jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.float32),
                 jnp.zeros((r, nt), jnp.float32)))
    return SampleOutput(next_ids=next_ids, logprob=logprob, top_ids=top_ids,
                        top_logprobs=top_lp, selected_logprobs=sel)
