// What bounds a step on this CPU: the rate at which 2 (or 1) threads read a buffer the size
// of the bf16 default model's weights (268 MB) with AVX-512 loads, and the VDPBF16PS /
// VFMADD zmm throughput of 12 independent accumulation chains per thread.
//
//   gcc -O2 -march=native -fopenmp scripts/roofline_probe.c -o /tmp/roofline_probe
//   OMP_NUM_THREADS=2 /tmp/roofline_probe      (needs AVX-512 with avx512_bf16)
//
// Figures and their CPU: docs/performance.md §11.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double read_seconds(const char* buf, size_t bytes) {
  double best = 1e9;
  for (int r = 0; r < 30; ++r) {
    double t0 = omp_get_wtime();
    __m512i total = _mm512_setzero_si512();
#pragma omp parallel
    {
      size_t chunk = bytes / omp_get_num_threads();
      const char* p = buf + omp_get_thread_num() * chunk;
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t i = 0; i + 256 <= chunk; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
      }
#pragma omp critical
      total = _mm512_add_epi64(total, _mm512_add_epi64(_mm512_add_epi64(a0, a1),
                                                       _mm512_add_epi64(a2, a3)));
    }
    double t = omp_get_wtime() - t0;
    if (t < best) best = t;
    if (_mm512_reduce_add_epi64(total) == 42) printf(" ");
  }
  return best;
}

#define DP(a) a = _mm512_dpbf16_ps(a, x, y)
#define FMA(a) a = _mm512_fmadd_ps(xf, xf, a)
static double macs_per_second(int bf16) {
  const long iters = 100000000;
  double best = 1e9;
  for (int r = 0; r < 3; ++r) {
    double t0 = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2),
             a3 = _mm512_set1_ps(3), a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5),
             a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7), a8 = _mm512_set1_ps(8),
             a9 = _mm512_set1_ps(9), a10 = _mm512_set1_ps(10), a11 = _mm512_set1_ps(11);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = x;
      const __m512 xf = _mm512_set1_ps(1e-9f);
      for (long i = 0; i < iters / 12; ++i) {
        if (bf16) {
          DP(a0); DP(a1); DP(a2); DP(a3); DP(a4); DP(a5);
          DP(a6); DP(a7); DP(a8); DP(a9); DP(a10); DP(a11);
        } else {
          FMA(a0); FMA(a1); FMA(a2); FMA(a3); FMA(a4); FMA(a5);
          FMA(a6); FMA(a7); FMA(a8); FMA(a9); FMA(a10); FMA(a11);
        }
      }
      sink += _mm512_reduce_add_ps(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11);
    }
    double t = omp_get_wtime() - t0;
    if (t < best) best = t;
    if (sink == 1) printf(" ");
  }
  return omp_get_max_threads() * (double)(iters / 12 * 12) * (bf16 ? 32 : 16) / best;
}

int main(void) {
  const size_t bytes = (size_t)268 << 20;
  char* buf = aligned_alloc(64, bytes);
  memset(buf, 1, bytes);
  double t = read_seconds(buf, bytes);
  printf("threads %d\nread 268 MB: %.2f ms, %.1f GB/s\n", omp_get_max_threads(), t * 1e3,
         bytes / t / 1e9);
  printf("VDPBF16PS zmm: %.1f GMAC/s\n", macs_per_second(1) / 1e9);
  printf("VFMADD231PS zmm: %.1f GMAC/s\n", macs_per_second(0) / 1e9);
  free(buf);
  return 0;
}
