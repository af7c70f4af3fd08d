// The per-token arithmetic of multiserve's CPU LoRA delta, shared by its two callers so
// that their bits are equal by construction (the same code, inlined into each):
//   - model/kernels/src/lora_delta.cc (`lora_delta_native`, `lora_apply_native`: any
//     number of tokens, in register blocks of NT tokens);
//   - model/kernels/src/row_gemm_lora.cc (the product with the applied delta in its
//     epilogue, one token).
//
// For one token of slot s and one projection (A [K, R], B [R, N] of slot s, scale sc):
//   xa[j] = the shrink: float32 in-order FMA over k = 0 .. K-1 from zero (`shrink_vec`,
//           `shrink_scalar`); bfloat16 pair sums in four chains (`shrink_bf16`);
//   d[n]  = (sum over j = 0 .. R-1 in order of xa[j] * B[j, n], one FMA each from zero)
//           * sc, rounded on its own (`expand_sums`, `expand_sum`, `scaled`);
//   y'[c] = round(float(y[c]) + d[n]) to y's type, once, to nearest even (`add_to`).
// How tokens are blocked, which columns share a vector and which thread runs them never
// changes these per-element operations or their order. Every multiply-add is float_ops.h's
// `fmadd`, the same operation in the vector and the scalar loops (one FMA where the build
// has FMA); nothing else is fused (the kernels build with -ffp-contract=off).

#ifndef MULTISERVE_NATIVE_LORA_MATH_H_
#define MULTISERVE_NATIVE_LORA_MATH_H_

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "float_ops.h"
#include "lanes16.h"

namespace multiserve::lora_math {

using multiserve::float_ops::fmadd;  // scalars; lanes16.h's for vectors (found by ADL)
// 16 float32 lanes (lanes16.h: one zmm with AVX-512, two ymm with AVX)
using vf = multiserve::lanes16::F16;
constexpr int LANES = 16;

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

using multiserve::lanes16::load;   // 16 floats, or 16 bfloat16 widened
using multiserve::lanes16::splat;  // every lane v's bits (a broadcast, no add)
using multiserve::lanes16::store;  // 16 floats, or 16 lanes rounded as from_float does

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return widen(v); }
inline void from_float(float v, float* out) { *out = v; }
inline void from_float(float v, uint16_t* out) {  // round to nearest even (no NaN here)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *out = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Columns [c, c + 16) of token t (c counted in the output row): d = acc * scale, stored
// The bfloat16 shrink: x and A are both bfloat16, so x @ A is sums of products of pairs
// (k, k + 1), one `vdpbf16ps` step each (the pair's two exact products added to the
// running float32 sum, with the instruction's own rounding, flushing subnormals). Its
// order, fixed by K alone: the P = K / 2 pairs in CHAINS contiguous segments of
// P / CHAINS pairs each (the last segment also the pairs left over and an odd K's last
// element, a pair of its own with a zero), each an in-order sum from zero, then
// xa = (s0 + s1) + (s2 + s3). Independent chains keep the FMA units busy where one token
// alone would wait on one sum's latency; the rank lanes past R (R not a multiple of 16)
// are loaded as zeros, so every R takes this one path.
constexpr int CHAINS = 4;
constexpr int64_t PREFETCH = 1024;  // elements read ahead of a stream (2 KB in bfloat16)

typedef uint16_t lane_mask;  // rank lanes of one vector: bit j set for a rank below R

#if defined(__AVX512BF16__)
typedef __m512bh pairs_t;
inline vf dot_pairs(vf acc, pairs_t a, pairs_t x) {  // (AVX-512: one 16-lane piece)
  vf r;
  r.p[0] = reinterpret_cast<multiserve::lanes16::pf>(
      _mm512_dpbf16_ps(reinterpret_cast<__m512>(acc.p[0]), a, x));
  return r;
}
// A[k, lanes] and A[k + 1, lanes] interleaved: (A[k, j], A[k + 1, j]) in lanes 2j, 2j + 1
inline pairs_t a_pairs(const uint16_t* row0, const uint16_t* row1, lane_mask lanes) {
  const __m512i idx = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __mmask16 mask = static_cast<__mmask16>(lanes);
  __m512i lo, hi;
  if (lanes == 0xFFFF) {  // a whole rank vector: plain loads
    lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0)));
    hi = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1)));
  } else {
    lo = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row0));
    hi = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row1));
  }
  return reinterpret_cast<pairs_t>(_mm512_permutex2var_epi16(lo, idx, hi));
}
inline pairs_t x_pair(uint32_t both) {
  return reinterpret_cast<pairs_t>(_mm512_set1_epi32(static_cast<int>(both)));
}
#else
// without avx512_bf16: the pair's two products added in turn (odd element first, as the
// instruction's definition), one FMA each
struct pairs_t { vf even, odd; };
inline vf dot_pairs(vf acc, pairs_t a, pairs_t x) {
  return fmadd(a.even, x.even, fmadd(a.odd, x.odd, acc));
}
inline vf masked_row(const uint16_t* row, lane_mask lanes) {
  float v[LANES];
  for (int j = 0; j < LANES; ++j) v[j] = (lanes >> j) & 1 ? widen(row[j]) : 0.0f;
  return load(v);
}
inline pairs_t a_pairs(const uint16_t* row0, const uint16_t* row1, lane_mask lanes) {
  return pairs_t{masked_row(row0, lanes), masked_row(row1, lanes)};
}
inline pairs_t x_pair(uint32_t both) {
  return pairs_t{splat(widen(static_cast<uint16_t>(both))),
                 splat(widen(static_cast<uint16_t>(both >> 16)))};
}
#endif

// x[2p], x[2p + 1] as one 32-bit pair (2p + 1 < K)
inline uint32_t pair_of(const uint16_t* x, int64_t p) {
  uint32_t both;
  std::memcpy(&both, x + 2 * p, sizeof both);
  return both;
}

// One pair step of NT tokens' RV rank vectors: acc += the pair (x[2p], x[2p + 1]) times
// A's rows 2p and 2p + 1 (row1 the same row as row0 for an odd K's last element, whose
// x pair has a zero second)
template <int RV, int NT>
__attribute__((always_inline)) inline void pair_step(vf (&acc)[NT][RV],
                                                     const uint16_t* const* xr,
                                                     const uint16_t* row0,
                                                     const uint16_t* row1,
                                                     const lane_mask* lanes, int64_t p,
                                                     bool odd_end) {
  pairs_t av[RV];
  __builtin_prefetch(row0 + PREFETCH);
  for (int v = 0; v < RV; ++v) av[v] = a_pairs(row0 + LANES * v, row1 + LANES * v, lanes[v]);
  for (int i = 0; i < NT; ++i) {
    const pairs_t xv = x_pair(odd_end ? xr[i][2 * p] : pair_of(xr[i], p));
    for (int v = 0; v < RV; ++v) acc[i][v] = dot_pairs(acc[i][v], av[v], xv);
  }
}

// Chains [c0, c0 + G) of the shrink of NT tokens, RV rank vectors: part[c][i][v] their
// segments' sums, the chains stepped together (G * NT * RV independent sums).
template <int RV, int NT, int G>
void shrink_chains(const uint16_t* const* xr, const uint16_t* ar, int64_t k, int64_t r,
                   const lane_mask* lanes, int c0, vf (*part)[NT][RV]) {
  const int64_t pairs = k / 2, len = pairs / CHAINS;
  vf acc[G][NT][RV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NT; ++i)
      for (int v = 0; v < RV; ++v) acc[g][i][v] = vf{};
  for (int64_t s = 0; s < len; ++s)
    for (int g = 0; g < G; ++g) {
      const int64_t p = (c0 + g) * len + s;
      pair_step<RV, NT>(acc[g], xr, ar + 2 * p * r, ar + (2 * p + 1) * r, lanes, p, false);
    }
  if (c0 + G == CHAINS) {  // the last chain's end: the pairs past CHAINS * len, odd K's last
    for (int64_t p = CHAINS * len; p < pairs; ++p)
      pair_step<RV, NT>(acc[G - 1], xr, ar + 2 * p * r, ar + (2 * p + 1) * r, lanes, p,
                        false);
    if (k % 2 == 1)
      pair_step<RV, NT>(acc[G - 1], xr, ar + (k - 1) * r, ar + (k - 1) * r, lanes, pairs,
                        true);
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NT; ++i)
      for (int v = 0; v < RV; ++v) part[c0 + g][i][v] = acc[g][i][v];
}


// The float32 shrink of NT tokens (rows xr[i]) against A [K, R] at `ar`: out[i][j] for
// RV vectors of 16 ranks each (each A row loaded once for all NT tokens).
template <typename E, int RV, int NT>
inline void shrink_vec(const E* const* xr, const E* ar, int64_t k_dim, int64_t r,
                       float* const* out) {
  vf acc[NT][RV];
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = vf{};
  for (int64_t k = 0; k < k_dim; ++k) {
    vf av[RV];
    for (int v = 0; v < RV; ++v) av[v] = load(ar + k * r + LANES * v);
    for (int i = 0; i < NT; ++i) {
      const vf xv = splat(widen(xr[i][k]));
      for (int v = 0; v < RV; ++v) acc[i][v] = fmadd(xv, av[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NT; ++i) std::memcpy(out[i], acc[i], sizeof acc[i]);
}

// The same sums one element at a time (any R up to 64), one token.
template <typename E>
inline void shrink_scalar(const E* xr, const E* ar, int64_t k_dim, int64_t r, float* out) {
  for (int64_t j = 0; j < r; ++j) {
    float acc = 0.0f;
    for (int64_t k = 0; k < k_dim; ++k) acc = fmadd(widen(xr[k]), widen(ar[k * r + j]), acc);
    out[j] = acc;
  }
}

// The bfloat16 shrink of NT tokens (above: four chains, then (c0 + c1) + (c2 + c3)).
template <int RV, int NT>
inline void shrink_bf16(const uint16_t* const* xr, const uint16_t* ar, int64_t k_dim,
                        int64_t r, float* const* out) {
  lane_mask lanes[RV];
  for (int v = 0; v < RV; ++v) {
    const int64_t n = std::min<int64_t>(LANES, r - LANES * v);
    lanes[v] = static_cast<lane_mask>((1u << n) - 1u);
  }
  // chains stepped together: up to 8 sums in registers (a block with more runs its chains
  // one at a time); which chains step together never changes a chain's sum
  constexpr int G = NT * RV <= 2 ? 4 : NT * RV <= 4 ? 2 : 1;
  vf part[CHAINS][NT][RV];
  for (int c0 = 0; c0 < CHAINS; c0 += G)
    shrink_chains<RV, NT, G>(xr, ar, k_dim, r, lanes, c0, part);
  static_assert(CHAINS == 4, "the combination below is of four chains");
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < RV; ++v) {
      const vf sum = (part[0][i][v] + part[1][i][v]) + (part[2][i][v] + part[3][i][v]);
      std::memcpy(out[i] + LANES * v, &sum, sizeof sum);
    }
}

// xa of NT tokens of one slot: out[i] (64 floats each; the lanes past R hold zeros or
// are not written) = x row xr[i] @ A [K, R] at `ar`, R <= 64.
template <typename E, int NT>
inline void shrink(const E* const* xr, const E* ar, int64_t k_dim, int64_t r,
                   float* const* out) {
  if constexpr (std::is_same_v<E, uint16_t>) {
    switch ((r + LANES - 1) / LANES) {
      case 1: shrink_bf16<1, NT>(xr, ar, k_dim, r, out); break;
      case 2: shrink_bf16<2, NT>(xr, ar, k_dim, r, out); break;
      case 3: shrink_bf16<3, NT>(xr, ar, k_dim, r, out); break;
      default: shrink_bf16<4, NT>(xr, ar, k_dim, r, out); break;
    }
    return;
  }
  switch (r % LANES == 0 ? r / LANES : 0) {
    case 1: shrink_vec<E, 1, NT>(xr, ar, k_dim, r, out); break;
    case 2: shrink_vec<E, 2, NT>(xr, ar, k_dim, r, out); break;
    case 3: shrink_vec<E, 3, NT>(xr, ar, k_dim, r, out); break;
    case 4: shrink_vec<E, 4, NT>(xr, ar, k_dim, r, out); break;
    default:
      for (int i = 0; i < NT; ++i) shrink_scalar<E>(xr[i], ar, k_dim, r, out[i]);
      break;
  }
}

// The expand's sums of NT tokens over CV vectors of 16 columns: acc[i][v] = sum over
// j in order of xa[i][j] * B[j, c] for the columns c of vector v, B's row j at
// br + j * stride (float32 or bfloat16, widened exactly).
template <typename S, int NT, int CV>
inline void expand_sums(const float* const* xa, const S* br, int64_t stride, int64_t r,
                        vf (&acc)[NT][CV]) {
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < CV; ++v) acc[i][v] = vf{};
  for (int64_t j = 0; j < r; ++j) {
    vf bv[CV];
    for (int v = 0; v < CV; ++v) bv[v] = load(br + j * stride + LANES * v);
    for (int i = 0; i < NT; ++i) {
      const vf xv = splat(xa[i][j]);
      for (int v = 0; v < CV; ++v) acc[i][v] = fmadd(xv, bv[v], acc[i][v]);
    }
  }
}

// One column's sum: B's row j at b + j * stride.
template <typename S>
inline float expand_sum(const float* xa, const S* b, int64_t stride, int64_t r) {
  float acc = 0.0f;
  for (int64_t j = 0; j < r; ++j) acc = fmadd(xa[j], widen(b[j * stride]), acc);
  return acc;
}

// d = acc * scale, rounded on its own (the add after it is a second operation)
inline vf scaled(vf acc, float sc) { return acc * sc; }
inline float scaled(float acc, float sc) { return acc * sc; }

// y' = y + d in float32, rounded once to y's type (16 columns, or one)
template <typename E>
inline void add_to(E* y, vf d) {
  store(load(y) + d, y);
}
template <typename E>
inline void add_to(E* y, float d) {
  from_float(to_float(*y) + d, y);
}

// One token's applied delta over `count` columns: y[c] += d[c] for c in [0, count), B's
// row j at b + j * stride (b at the first column), in vectors of 64, 16, then one column
// at a time (which grouping never changes an element's operations).
template <typename E>
inline void apply_columns(const float* xa, const E* b, int64_t stride, int64_t r,
                          int64_t count, float sc, E* y) {
  const float* xs[1] = {xa};
  int64_t c = 0;
  for (; c + 4 * LANES <= count; c += 4 * LANES) {
    vf acc[1][4];
    expand_sums<E, 1, 4>(xs, b + c, stride, r, acc);
    for (int v = 0; v < 4; ++v) add_to(y + c + LANES * v, scaled(acc[0][v], sc));
  }
  for (; c + LANES <= count; c += LANES) {
    vf acc[1][1];
    expand_sums<E, 1, 1>(xs, b + c, stride, r, acc);
    add_to(y + c, scaled(acc[0][0], sc));
  }
  for (; c < count; ++c) add_to(y + c, scaled(expand_sum(xa, b + c, stride, r), sc));
}

}  // namespace multiserve::lora_math

#endif  // MULTISERVE_NATIVE_LORA_MATH_H_
