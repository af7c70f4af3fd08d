// The floating-point operations every multiserve CPU kernel computes with, written out so
// that their rounding is the source's and never the compiler's choice.
//
// The kernels are built with -ffp-contract=off (native.py FLAGS): the compiler never fuses
// a multiply with an add on its own, so `a * b + c` is two roundings everywhere. A fused
// multiply-add is written as `fmadd` (one rounding), for 16-lane vectors and for scalars
// alike:
//   - with FMA (any x86-64-v3 or AVX-512 build): an FMA instruction, per lane or scalar;
//   - without (an SSE-only build): the multiply then the add, for vectors and scalars
//     alike, so within one build a vector lane and a scalar computing the same sum give
//     the same bits.
// So two code paths that perform the same operations in the same order on the same
// operands give the same bits in any build for any -march, whatever the compiler
// vectorises (its SLP pass once turned four multiply-adds of a scalar chain into one
// vector multiply and four scalar adds on one CPU's tuning and not on another's).
// tests/model/test_kernel_arithmetic.py builds a probe of this arithmetic for several
// -march targets and compares their bits.

#ifndef MULTISERVE_NATIVE_FLOAT_OPS_H_
#define MULTISERVE_NATIVE_FLOAT_OPS_H_

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include <cstring>

namespace multiserve::float_ops {

// 16 float32 lanes (GCC vector extensions: one zmm with AVX-512, two ymm with AVX, four
// xmm with SSE); lanes never mix except where a kernel shuffles them explicitly.
typedef float vf __attribute__((vector_size(64)));

#if defined(__AVX512F__) || defined(__FMA__)
constexpr bool FUSED = true;
#else
constexpr bool FUSED = false;
#endif

// a * b + c per lane, rounded once where FUSED, else twice
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                             reinterpret_cast<__m512>(c));
  return reinterpret_cast<vf>(r);
#elif defined(__FMA__)
  typedef float half_t __attribute__((vector_size(32)));
  half_t ah[2], bh[2], ch[2];
  std::memcpy(ah, &a, sizeof a);
  std::memcpy(bh, &b, sizeof b);
  std::memcpy(ch, &c, sizeof c);
  for (int i = 0; i < 2; ++i)
    ch[i] = reinterpret_cast<half_t>(_mm256_fmadd_ps(reinterpret_cast<__m256>(ah[i]),
                                                     reinterpret_cast<__m256>(bh[i]),
                                                     reinterpret_cast<__m256>(ch[i])));
  vf r;
  std::memcpy(&r, ch, sizeof r);
  return r;
#else
  return a * b + c;
#endif
}

// the same for one float (where FUSED, the scalar FMA instruction: the builtin is fused by
// definition, and a build with FMA or AVX-512F emits it inline)
inline float fmadd(float a, float b, float c) {
  if constexpr (FUSED) return __builtin_fmaf(a, b, c);
  return a * b + c;
}

}  // namespace multiserve::float_ops

#endif  // MULTISERVE_NATIVE_FLOAT_OPS_H_
