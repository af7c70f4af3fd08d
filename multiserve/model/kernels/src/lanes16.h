// Sixteen float32 (F16) or int32 (I16) lanes held as pieces of the build's native vector
// width: one 16-lane vector with AVX-512, two 8-lane ones with AVX. Every operation is
// lane-wise per piece, or a fixed data movement (the shuffles below); so a kernel written
// on these types computes each lane by the same operations on the same operands whatever
// the piece width, and its bits are the same in every build that fuses multiply-adds.
//
// Why pieces: GCC gives a 64-byte generic vector no machine mode where the build lacks
// AVX-512, so such a value lives in memory and every operation on it is split into
// loads, 32-byte operations and stores (a broadcast becomes 16 scalar stores). A struct of
// native-width vectors is split into registers by the compiler's scalar replacement.
// MULTISERVE_GENERIC_BLOCK (and any build without AVX) keeps one 64-byte generic vector,
// the probe's other path (tests/model/test_kernel_arithmetic.py compares the two).

#ifndef MULTISERVE_NATIVE_LANES16_H_
#define MULTISERVE_NATIVE_LANES16_H_

#include <cstdint>
#include <cstring>

#include "float_ops.h"

namespace multiserve::lanes16 {

#if !defined(__AVX512F__) && defined(__AVX__) && !defined(MULTISERVE_GENERIC_BLOCK)
#define LANES16_W 8
#else
#define LANES16_W 16
#endif
constexpr int W = LANES16_W;  // lanes per piece
constexpr int N = 16 / W;  // pieces

typedef float pf __attribute__((vector_size(4 * W)));
typedef int32_t pi __attribute__((vector_size(4 * W)));
typedef uint32_t pu __attribute__((vector_size(4 * W)));

#define LANES16_INLINE __attribute__((always_inline)) inline

struct F16 {
  pf p[N];  // lanes 0..W-1, then W..15
};
struct I16 {
  pi p[N];
};

// every lane x's bits (a broadcast: no add, so -0 stays -0)
LANES16_INLINE F16 splat(float x) {
  F16 r;
#if LANES16_W == 16
  r.p[0] = pf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  for (int i = 0; i < N; ++i) r.p[i] = pf{x, x, x, x, x, x, x, x};
#endif
  return r;
}
LANES16_INLINE I16 splat_i(int32_t x) {
  I16 r;
  for (int i = 0; i < N; ++i) r.p[i] = pi{} + x;
  return r;
}
LANES16_INLINE F16 load(const float* src) {
  F16 r;
  std::memcpy(r.p, src, sizeof r.p);
  return r;
}
LANES16_INLINE void store(const F16& a, float* dst) { std::memcpy(dst, a.p, sizeof a.p); }

// the 32-bit words at src as lanes (bit patterns, e.g. two bfloat16 a word)
LANES16_INLINE I16 load_words(const void* src) {
  I16 r;
  std::memcpy(r.p, src, sizeof r.p);
  return r;
}
LANES16_INLINE F16 as_float(const I16& a) {
  F16 r;
  for (int i = 0; i < N; ++i) r.p[i] = reinterpret_cast<pf>(a.p[i]);
  return r;
}
// 16 bfloat16 (their bits) widened to float32 (exact: the bits become a float's high half)
LANES16_INLINE F16 load(const uint16_t* src) {
  F16 r;
#if defined(__AVX512F__) && LANES16_W == 16
  // one zero-extending load of the 16 halves, then the shift (GCC splits the generic form)
  const __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
  std::memcpy(r.p, &u, sizeof r.p);
#else
  typedef uint16_t ph __attribute__((vector_size(2 * W)));
  for (int i = 0; i < N; ++i) {
    ph h;
    std::memcpy(&h, src + W * i, sizeof h);
    r.p[i] = reinterpret_cast<pf>(__builtin_convertvector(h, pu) << 16);
  }
#endif
  return r;
}
// 16 lanes rounded to bfloat16, to nearest even (no NaN here), their bits stored at dst
LANES16_INLINE void store(const F16& a, uint16_t* dst) {
  typedef uint16_t ph __attribute__((vector_size(2 * W)));
  for (int i = 0; i < N; ++i) {
    const pu u = reinterpret_cast<pu>(a.p[i]);
    const ph h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, ph);
    std::memcpy(dst + W * i, &h, sizeof h);
  }
}
LANES16_INLINE float lane(const F16& a, int j) { return a.p[j / W][j % W]; }
LANES16_INLINE I16 iota() {
  I16 r;
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < W; ++l) r.p[i][l] = W * i + l;
  return r;
}

#define LANES16_BINARY(T, OP)                                                      \
  LANES16_INLINE T operator OP(const T& a, const T& b) {                           \
    T r;                                                                           \
    for (int i = 0; i < N; ++i) r.p[i] = a.p[i] OP b.p[i];                         \
    return r;                                                                      \
  }
LANES16_BINARY(F16, +)
LANES16_BINARY(F16, -)
LANES16_BINARY(F16, *)
LANES16_BINARY(F16, /)
LANES16_BINARY(I16, +)
LANES16_BINARY(I16, &)
#undef LANES16_BINARY

LANES16_INLINE F16 operator-(const F16& a) {
  F16 r;
  for (int i = 0; i < N; ++i) r.p[i] = -a.p[i];
  return r;
}
LANES16_INLINE F16 operator*(const F16& a, float b) { return a * splat(b); }
LANES16_INLINE F16 operator/(const F16& a, float b) { return a / splat(b); }
LANES16_INLINE F16 operator+(const F16& a, float b) { return a + splat(b); }
LANES16_INLINE F16 operator-(const F16& a, float b) { return a - splat(b); }
LANES16_INLINE F16& operator*=(F16& a, float b) { return a = a * b; }
LANES16_INLINE I16 operator+(const I16& a, int32_t b) { return a + splat_i(b); }
LANES16_INLINE I16 operator<<(const I16& a, int b) {
  I16 r;
  for (int i = 0; i < N; ++i) r.p[i] = a.p[i] << b;
  return r;
}

// comparisons: a lane is -1 (all bits) where true, 0 where false
#define LANES16_COMPARE(NAME, T, OP)                                               \
  LANES16_INLINE I16 NAME(const T& a, const T& b) {                                \
    I16 r;                                                                         \
    for (int i = 0; i < N; ++i) r.p[i] = a.p[i] OP b.p[i];                         \
    return r;                                                                      \
  }
LANES16_COMPARE(less, F16, <)
LANES16_COMPARE(less, I16, <)
LANES16_COMPARE(equal, I16, ==)
LANES16_COMPARE(at_least, I16, >=)
#undef LANES16_COMPARE

// a where the mask's lane is true, else b
LANES16_INLINE F16 select(const I16& m, const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < N; ++i) r.p[i] = m.p[i] ? a.p[i] : b.p[i];
  return r;
}

// truncation toward zero, and back
LANES16_INLINE I16 truncate(const F16& a) {
  I16 r;
  for (int i = 0; i < N; ++i) r.p[i] = __builtin_convertvector(a.p[i], pi);
  return r;
}
LANES16_INLINE F16 to_float(const I16& a) {
  F16 r;
  for (int i = 0; i < N; ++i) r.p[i] = __builtin_convertvector(a.p[i], pf);
  return r;
}

// a * b + c per lane with float_ops.h's rounding: once where the build has FMA
LANES16_INLINE F16 fmadd(const F16& a, const F16& b, const F16& c) {
  F16 r;
#if LANES16_W == 16
    r.p[0] = multiserve::float_ops::fmadd(a.p[0], b.p[0], c.p[0]);
#else
#if defined(__FMA__)
    for (int i = 0; i < N; ++i)
      r.p[i] = reinterpret_cast<pf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a.p[i]),
                                                    reinterpret_cast<__m256>(b.p[i]),
                                                    reinterpret_cast<__m256>(c.p[i])));
#else
    for (int i = 0; i < N; ++i) r.p[i] = a.p[i] * b.p[i] + c.p[i];
#endif
#endif
  return r;
}

// ---- data movement (no arithmetic) and the fixed trees built on it ----

// PICK(a, b, i0..i7): lanes i0..i7 of a's 16 lanes, then the same lanes of b's, each
// index a constant below 16 (as __builtin_shufflevector(a, b, i0..i7, i0 + 16..i7 + 16) on
// one 16-lane vector; with 8-lane pieces each output piece comes from one input's two).
#if LANES16_W == 16
#define LANES16_PICK(A, B, i0, i1, i2, i3, i4, i5, i6, i7)                                 \
  (F16{{__builtin_shufflevector((A).p[0], (B).p[0], i0, i1, i2, i3, i4, i5, i6, i7,        \
                                i0 + 16, i1 + 16, i2 + 16, i3 + 16, i4 + 16, i5 + 16,      \
                                i6 + 16, i7 + 16)}})
#else
#define LANES16_PICK(A, B, i0, i1, i2, i3, i4, i5, i6, i7)                                 \
  (F16{{__builtin_shufflevector((A).p[0], (A).p[N - 1], i0, i1, i2, i3, i4, i5, i6, i7),   \
        __builtin_shufflevector((B).p[0], (B).p[N - 1], i0, i1, i2, i3, i4, i5, i6, i7)}})
#endif

// hsum's tree for 16 vectors at once, in four stages: lane j of the last stage is exactly
// hsum(d_j) (the same additions of the same operands). Each stage adds two picks of its
// two inputs.
// Stage 1: [lo8(a) + hi8(a), lo8(b) + hi8(b)] (hsum's b, two keys).
LANES16_INLINE F16 halves8(const F16& a, const F16& b) {
  return LANES16_PICK(a, b, 0, 1, 2, 3, 4, 5, 6, 7) +
         LANES16_PICK(a, b, 8, 9, 10, 11, 12, 13, 14, 15);
}
// Stage 2: per input, its 4-lane quarters added pairwise (hsum's c, four keys).
LANES16_INLINE F16 halves4(const F16& a, const F16& b) {
  return LANES16_PICK(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         LANES16_PICK(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
// Stage 3: per input, lanes 4i, 4i + 1 plus 4i + 2, 4i + 3 ([c0 + c2, c1 + c3], eight keys).
LANES16_INLINE F16 pairs02(const F16& a, const F16& b) {
  return LANES16_PICK(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
         LANES16_PICK(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
// Stage 4: per input, even lanes plus odd lanes ((c0 + c2) + (c1 + c3), 16 keys).
LANES16_INLINE F16 adjacent(const F16& a, const F16& b) {
  return LANES16_PICK(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         LANES16_PICK(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

// The sum of the 16 lanes by a fixed tree: b = lanes 0..7 + 8..15, c = b0..3 + b4..7,
// (c0 + c2) + (c1 + c3).
LANES16_INLINE float hsum(const F16& a) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 b;
#if LANES16_W == 16
    b = __builtin_shufflevector(a.p[0], a.p[0], 0, 1, 2, 3, 4, 5, 6, 7) +
        __builtin_shufflevector(a.p[0], a.p[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    b = a.p[0] + a.p[N - 1];
#endif
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// The largest lane (lane 0 of a tree of lane-wise maxima: with lanes i and i + 8, then
// i + 4, i + 2, i + 1 within each eight; the same comparisons in every build).
LANES16_INLINE float hmax(const F16& a) {
  typedef float v8 __attribute__((vector_size(32)));
  auto max8 = [](v8 x, v8 y) { return x > y ? x : y; };
  v8 m;
#if LANES16_W == 16
    m = max8(__builtin_shufflevector(a.p[0], a.p[0], 0, 1, 2, 3, 4, 5, 6, 7),
             __builtin_shufflevector(a.p[0], a.p[0], 8, 9, 10, 11, 12, 13, 14, 15));
#else
    m = max8(a.p[0], a.p[N - 1]);
#endif
  m = max8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
  m = max8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
  m = max8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6));
  return m[0];
}

// Two vectors of 16 consecutive values (a: 0..15, b: 16..31) as their even values and
// their odd values, and back.
LANES16_INLINE void deinterleave(const F16& a, const F16& b, F16& even, F16& odd) {
  even = LANES16_PICK(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
  odd = LANES16_PICK(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
LANES16_INLINE void interleave(const F16& even, const F16& odd, F16& a, F16& b) {
#if LANES16_W == 16
    a.p[0] = __builtin_shufflevector(even.p[0], odd.p[0], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20,
                                     5, 21, 6, 22, 7, 23);
    b.p[0] = __builtin_shufflevector(even.p[0], odd.p[0], 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                     28, 13, 29, 14, 30, 15, 31);
#else
    a.p[0] = __builtin_shufflevector(even.p[0], odd.p[0], 0, 8, 1, 9, 2, 10, 3, 11);
    a.p[N - 1] = __builtin_shufflevector(even.p[0], odd.p[0], 4, 12, 5, 13, 6, 14, 7, 15);
    b.p[0] = __builtin_shufflevector(even.p[N - 1], odd.p[N - 1], 0, 8, 1, 9, 2, 10, 3, 11);
    b.p[N - 1] = __builtin_shufflevector(even.p[N - 1], odd.p[N - 1], 4, 12, 5, 13, 6, 14, 7,
                                         15);
#endif
}
#undef LANES16_PICK

}  // namespace multiserve::lanes16

#endif  // MULTISERVE_NATIVE_LANES16_H_
