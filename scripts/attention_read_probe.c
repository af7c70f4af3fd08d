// The read bound of a decode step's paged attention on this machine: the K and V rows that
// the native kernel reads for 64 decode rows (SmolLM2-135M: 30 layers, 3 KV heads,
// head_dim 64, bfloat16, pages of 16 slots in random order; 100-219 keys a row, as
// scripts/bench_attention.py's decode64_30layers case), read by plain AVX-512 loads and
// nothing else, items (row, KV head) split over the threads as the kernel splits them.
// What it prints is the least time that case can take with this layout: every 2 KiB page
// row of K and of V is a separate run in memory, which streams slower than one buffer.
//
//   gcc -O2 -march=native -fopenmp scripts/attention_read_probe.c -o /tmp/attention_read_probe
//   /tmp/attention_read_probe 2     # threads (the engine's: one per core)
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { LAYERS = 30, KV_HEADS = 3, HEAD_DIM = 64, PAGE = 16, ROWS = 64, MAX_PAGES = 16 };

static int sink[ROWS * KV_HEADS * 16];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  srand(1);
  int lens[ROWS], pages[ROWS], total = 0;
  for (int r = 0; r < ROWS; ++r) {
    lens[r] = 100 + rand() % 120;
    pages[r] = (lens[r] + PAGE - 1) / PAGE;
    total += pages[r];
  }
  const int pool_pages = total + 4;
  int* order = malloc(sizeof(int) * pool_pages);
  for (int i = 0; i < pool_pages; ++i) order[i] = i;
  for (int i = pool_pages - 1; i > 0; --i) {
    const int j = rand() % (i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  static int table[ROWS][MAX_PAGES];
  for (int r = 0, c = 0; r < ROWS; ++r)
    for (int p = 0; p < pages[r]; ++p) table[r][p] = order[c++];
  const long slots = (long)pool_pages * PAGE;
  const size_t n = (size_t)LAYERS * KV_HEADS * slots * HEAD_DIM;
  uint16_t* k = aligned_alloc(64, n * 2);
  uint16_t* v = aligned_alloc(64, n * 2);
  for (size_t i = 0; i < n; ++i) k[i] = (uint16_t)i, v[i] = (uint16_t)(3 * i);
  double best = 1e9;
  long bytes = 0;
  for (int rep = 0; rep < 15; ++rep) {
    const double t0 = now();
    long read = 0;
    for (int l = 0; l < LAYERS; ++l) {  // one kernel call per layer, as in the step
#pragma omp parallel for num_threads(threads) schedule(dynamic, 12) reduction(+ : read)
      for (int item = 0; item < ROWS * KV_HEADS; ++item) {
        const int r = item / KV_HEADS, h = item % KV_HEADS;
        const size_t base = (size_t)(l * KV_HEADS + h) * slots * HEAD_DIM;
        __m512i acc = _mm512_setzero_si512();
        for (int key = 0; key < lens[r]; ++key) {
          const long slot = (long)table[r][key / PAGE] * PAGE + key % PAGE;
          const __m512i* kr = (const __m512i*)(k + base + slot * HEAD_DIM);
          const __m512i* vr = (const __m512i*)(v + base + slot * HEAD_DIM);
          acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_add_epi32(kr[0], kr[1]),
                                                       _mm512_add_epi32(vr[0], vr[1])));
          read += 4 * 64;
        }
        _mm512_storeu_si512((void*)(sink + item * 16), acc);
      }
    }
    const double dt = now() - t0;
    if (dt < best) best = dt;
    bytes = read;
  }
  printf("%d threads: best %.2f ms for %.1f MB (%.1f GB/s)\n", threads, best * 1e3, bytes / 1e6,
         bytes / best / 1e9);
  return 0;
}
