// One panel of multiserve's row-invariant products (row_gemm.cc, row_gemm_bf16.cc) at ONE
// row, for a kernel that adds its own epilogue after the product's (row_gemm_lora.cc):
// the same register block and the same store as the products' own handlers, so the panel's
// bits are theirs.

#ifndef MULTISERVE_NATIVE_ROW_PANEL_H_
#define MULTISERVE_NATIVE_ROW_PANEL_H_

#include <cstdint>

namespace multiserve {

// Bytes the caller will read next, prefetched into L2 at an even rate through a panel's
// k loop (the products' own warming of their next panel, applied to another region).
// Prefetches change no arithmetic.
struct Warm {
  const void* start = nullptr;  // nullptr: none
  int64_t bytes = 0;
};

// A register block's warming of the rows it reads next, through its k loop: `step()` once
// a k step prefetches, every `every`-th step, the next of `count` panel rows of
// PANEL_ROW_BYTES (4 cache lines: a float32 panel's row, a bfloat16 panel's pair row) from
// `rows`, into L2, or L1 with `to_l1` (prefetcht0). By counters: no division in the k loop
// (docs/performance.md §3). Built from a kernel's own WarmRows (rows, every, count, to_l1).
constexpr int64_t PANEL_ROW_BYTES = 256;

struct PanelWarmer {
  const char* next;
  int64_t countdown = 1, left, every;
  bool to_l1;
  template <typename WarmRows>
  explicit PanelWarmer(const WarmRows& w)
      : next(reinterpret_cast<const char*>(w.rows)), left(w.count), every(w.every),
        to_l1(w.to_l1) {}
  inline void step() {
    if (--countdown != 0) return;
    countdown = every;
    if (left <= 0) return;
    if (to_l1)
      for (int c = 0; c < PANEL_ROW_BYTES; c += 64) __builtin_prefetch(next + c, 0, 3);
    else
      for (int c = 0; c < PANEL_ROW_BYTES; c += 64) __builtin_prefetch(next + c, 0, 2);
    next += PANEL_ROW_BYTES;
    --left;
  }
};

// y[64p, 64p + 64) = x @ columns [64p, 64p + 64) of W, then with `res` (not nullptr)
// res + that in float32 (one add, as XLA adds a float32 residual to the product): x [K],
// `panels` the chosen layer's float32 panels [P, K, 64], y and res rows of P * 64.
void row_gemm_panel(const float* x, int64_t k, const float* panels, int64_t p, float* y,
                    const float* res, Warm warm = {});

// One row against bfloat16 k-pair panels [P, ceil(K / 2), 128] of the chosen layer.
struct Bf16Row {
  const void* x;  // [K], float32 or bfloat16 (x_bf16)
  bool x_bf16;
  const uint16_t* panels;
  int64_t k, panels_count;
  void* y;  // [P * 64], float32 or bfloat16 (y_bf16)
  bool y_bf16;
  const uint16_t* res;  // [P * 64] bfloat16 residual (y bfloat16 only), or nullptr
  int64_t path;  // row_gemm_bf16.cc's Path: 0 kDot (x bfloat16, AVX512_BF16), 1 kWiden,
                 // 2 kAmx (x bfloat16, AMX-BF16 tiles)
};

// y[64p, 64p + 64) of `row`: store_row's rounding and residual add, as the dense product.
// A thread that ran panels of path 2 (kAmx) calls row_gemm_bf16_release at the end of its
// work range (the AMX tiles stay configured between its panels).
void row_gemm_bf16_panel(const Bf16Row& row, int64_t p, Warm warm = {});
void row_gemm_bf16_release();

// Whether `path` 0 (kDot) runs in this build and CPU.
bool row_gemm_bf16_dot_available();

// Whether `path` 2 (kAmx) runs in this build, CPU and kernel.
bool row_gemm_bf16_amx_available();

}  // namespace multiserve

#endif  // MULTISERVE_NATIVE_ROW_PANEL_H_
