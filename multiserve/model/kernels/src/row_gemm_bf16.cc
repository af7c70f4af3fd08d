// multiserve's CPU row-invariant matrix product against bfloat16 weights, an XLA FFI custom
// call (built and loaded by multiserve/model/kernels/native.py): row_gemm.cc's construction
// with weights streamed at half the bytes.
//
// y[M, N] = x[M, K] @ W, x float32 or bfloat16, y float32 or bfloat16 (each element rounded
// once from its float32 sum, to nearest even), W bfloat16 given PACKED as k-PAIR panels
// wp[L, N / 64, ceil(K / 2), 128]: element (l, p, j, 2c + e) is W_l[2j + e, 64p + c] (a
// 32-bit lane c holds the pair of rows 2j, 2j + 1 of column 64p + c, row 2j in the low
// half; an odd K's last pair has a zero high half). `pack_panels` of a bfloat16 W.
//
// Three instruction paths, the same layout, DIFFERENT bits:
//   - kDot (AVX512_BF16, x bfloat16 only): one VDPBF16PS per pair of k, which adds both
//     products of the pair to the float32 accumulator in one instruction (its own rounding;
//     denormal inputs and outputs flushed to zero). Each y[m, n] is the accumulator from
//     zero, then pair 0, pair 1, .., in order.
//   - kWiden (any AVX2 / AVX-512F CPU, and every float32 x): each bfloat16 widened to
//     float32 in registers (exact), then one fused multiply-add per k (float_ops.h's
//     `fmadd`), k = 0, 1, .., K - 1 in
//     order from zero: exactly row_gemm.cc's sum over the widened operands, so its bits are
//     the float32 kernel's on x.astype(float32) and W.astype(float32).
//   - kAmx (Intel AMX-BF16 tiles, x bfloat16 only; amx_panel.h): blocks of up to 16 rows, each
//     element the tile instruction's sums over blocks of 16 pairs of k in order (amx_panel.h
//     states them; denormals flushed as kDot).
// Row invariance BY CONSTRUCTION on every path: the tiling (6-row or 16-row blocks, 64-column
// panels, panels over threads) decides where an element is computed, never the order of its
// sum. But an engine must run ONE path for a given product at every row count, or a row's
// bits would depend on the batch: the path is an explicit argument of every call (the
// engine's invariance plan names one for all its products: Formulation.path), never chosen
// from M.
//
// The GROUPED product (mixture-of-experts experts), as in row_gemm.cc: y[m] = x[m] @
// W[groups[m]], panels wp[G, N / 64, ceil(K / 2), 128], register blocks of up to 6
// consecutive rows of one group.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "amx_panel.h"
#include "float_ops.h"
#include "product_split.h"
#include "row_panel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using multiserve::for_each_item;
using multiserve::work_units;

namespace {

using multiserve::float_ops::fmadd;
using multiserve::float_ops::vf;
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int NV = 4;              // vectors per panel row
constexpr int PANEL = 16 * NV;     // columns per panel
constexpr int PAIR_ROW = 2 * PANEL;  // bfloat16 per panel row (one pair of k)
constexpr int MR = 6;              // rows per register block

enum Path : int64_t { kDot = 0, kWiden = 1, kAmx = 2 };

// rows of x one work item's register (or tile) block holds
inline int64_t block_rows_for(Path path) { return path == kAmx ? multiserve::amx::ROWS : MR; }

bool dot_available() {
#if defined(__AVX512BF16__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

inline vu load_u(const uint16_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf as_f(vu v) {
  vf f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}

// a pair lane's row 2j (low half) and row 2j + 1 (high half) as float32, exactly
inline vf even_k(vu v) { return as_f(v << 16); }
inline vf odd_k(vu v) { return as_f(v & 0xffff0000u); }

inline float x_at(const float* x, int64_t i) { return x[i]; }
inline float x_at(const uint16_t* x, int64_t i) {
  const uint32_t u = uint32_t{x[i]} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Where a block's rows go: y[M, ldy] float32 or bfloat16; with `res` (bfloat16 y only) each
// element becomes res + y in the residual stream's arithmetic (below).
struct Out {
  void* y;
  bool bf16;
  int64_t ldy;
  const uint16_t* res = nullptr;  // [M, ldy] bfloat16, or nullptr
};

// float32 -> bfloat16, round to nearest even (NaN stays a quiet NaN): ml_dtypes' rounding.
inline vh to_bf16(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (u >> 16) | 0x40u;
  const vu r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return __builtin_convertvector(r, vh);
}

inline vf widen(vh h) { return even_k(__builtin_convertvector(h, vu)); }  // exact

// The epilogue: the product rounded once to bfloat16, then, with a residual, the bfloat16
// sum res + y as XLA computes a bfloat16 add (both widened exactly, one float32 add, one
// rounding): the bits of `res + product` computed apart, one pass over y fewer.
inline void store_row(const Out& out, int64_t row, int64_t col, const vf (&acc)[NV]) {
  if (out.bf16) {
    uint16_t* dst = static_cast<uint16_t*>(out.y) + row * out.ldy + col;
    const uint16_t* res = out.res == nullptr ? nullptr : out.res + row * out.ldy + col;
    for (int j = 0; j < NV; ++j) {
      vh h = to_bf16(acc[j]);
      if (res != nullptr) {
        vh r;
        std::memcpy(&r, res + 16 * j, sizeof r);
        h = to_bf16(widen(r) + widen(h));
      }
      std::memcpy(dst + 16 * j, &h, sizeof h);
    }
  } else {
    std::memcpy(static_cast<float*>(out.y) + row * out.ldy + col, acc, sizeof acc);
  }
}

// Rows of the NEXT panel to prefetch into L2 while a block runs (row_gemm.cc's WarmRows):
// at every `every`-th pair step the next of `count` panel rows (256 bytes, 4 cache lines).
struct WarmRows {
  const uint16_t* rows = nullptr;  // nullptr: none
  int64_t every = 1, count = 0;
  bool to_l1 = false;  // prefetcht0 (row_panel.h's Warm) instead of prefetcht1
};

using multiserve::PanelWarmer;  // row_panel.h
static_assert(PAIR_ROW * sizeof(uint16_t) == multiserve::PANEL_ROW_BYTES);

#if !defined(__AVX512F__) && defined(__FMA__) && !defined(MULTISERVE_GENERIC_BLOCK)
// kWiden on AVX2 + FMA builds (16 ymm registers): row_gemm.cc's column passes, the same
// widening and the same sums (one _mm256_fmadd_ps per k in order from zero, float_ops.h's
// fmadd lane by lane): each pass covers `pass_ymm(R)` ymm of the panel's 8 through the whole
// k loop into a row buffer, then the rows go through the generic block's epilogue. The first
// pass warms. MULTISERVE_GENERIC_BLOCK builds the generic block instead (the probe's
// comparison, tests/model/test_kernel_arithmetic.py).
constexpr int pass_ymm(int r) { return r == 1 ? 8 : r <= 3 ? 4 : 2; }

inline __m256 even_k8(const uint16_t* p) {  // 8 pair lanes' rows 2j, exactly
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 odd_k8(const uint16_t* p) {  // their rows 2j + 1
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));
}

template <int R, bool WARM, typename X>
void block_widen(const X* x, int64_t k_dim, const uint16_t* panel, const Out& out,
                 int64_t col, int64_t m0, WarmRows warm) {
  constexpr int C = pass_ymm(R);
  static_assert((PANEL / 8) % C == 0);
  const X* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k_dim;
  alignas(64) float rows[R][PANEL];
  const int64_t pairs = k_dim / 2;
  for (int c0 = 0; c0 < PANEL / 8; c0 += C) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
    PanelWarmer warmer(warm);
    const uint16_t* lanes = panel + 16 * c0;  // 8 pair lanes = 16 bfloat16 a ymm
    auto step = [&](const uint16_t* row, int64_t k, bool odd) {
      __m256 b[C];
      for (int j = 0; j < C; ++j) b[j] = odd ? odd_k8(row + 16 * j) : even_k8(row + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(x_at(xr[r], k));
        for (int j = 0; j < C; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
      }
    };
    for (int64_t p = 0; p < pairs; ++p) {
      if (WARM && c0 == 0) warmer.step();
      const uint16_t* row = lanes + p * PAIR_ROW;
      step(row, 2 * p, false);
      step(row, 2 * p + 1, true);
    }
    if (k_dim % 2) step(lanes + pairs * PAIR_ROW, 2 * pairs, false);  // the last k alone
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) _mm256_store_ps(&rows[r][8 * (c0 + j)], acc[r][j]);
  }
  for (int r = 0; r < R; ++r) {
    vf acc_row[NV];
    std::memcpy(acc_row, rows[r], sizeof acc_row);
    store_row(out, m0 + r, col, acc_row);
  }
}
#else
// kWiden: rows [m0, m0 + R) of one panel, R x 64 float32 accumulators, one FMA per k in
// order (row 2j of a pair before row 2j + 1).
template <int R, bool WARM, typename X>
void block_widen(const X* x, int64_t k_dim, const uint16_t* panel, const Out& out,
                 int64_t col, int64_t m0, WarmRows warm) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  const X* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k_dim;
  PanelWarmer warmer(warm);
  const int64_t pairs = k_dim / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    if (WARM) warmer.step();
    const uint16_t* row = panel + p * PAIR_ROW;
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = even_k(load_u(row + 32 * j));
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + x_at(xr[r], 2 * p);
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(a, b[j], acc[r][j]);
    }
    for (int j = 0; j < NV; ++j) b[j] = odd_k(load_u(row + 32 * j));
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + x_at(xr[r], 2 * p + 1);
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(a, b[j], acc[r][j]);
    }
  }
  if (k_dim % 2) {  // the last k alone (its pair's high half is padding)
    const uint16_t* row = panel + pairs * PAIR_ROW;
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = even_k(load_u(row + 32 * j));
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + x_at(xr[r], 2 * pairs);
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(out, m0 + r, col, acc[r]);
}
#endif

#if defined(__AVX512BF16__)
// kDot: rows [m0, m0 + R) of one panel, one VDPBF16PS per pair of k in order (an odd K's
// last pair is (x[K - 1], 0) against (W[K - 1], 0)).
template <int R, bool WARM>
void block_dot(const uint16_t* x, int64_t k_dim, const uint16_t* panel, const Out& out,
               int64_t col, int64_t m0, WarmRows warm) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k_dim;
  PanelWarmer warmer(warm);
  // pair p of row r: (x[2p], x[2p + 1]) as one 32-bit lane; an odd K's last pair is
  // (x[K - 1], 0). The whole pairs run in a loop of their own (no per-pair test).
  const auto step = [&](int64_t p, const uint32_t (&pair)[R]) {
    const uint16_t* row = panel + p * PAIR_ROW;
    __m512i b[NV];
    for (int j = 0; j < NV; ++j) b[j] = _mm512_loadu_si512(row + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(pair[r]));
      for (int j = 0; j < NV; ++j)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)a, (__m512bh)b[j]);
    }
  };
  const int64_t whole = k_dim / 2;
  for (int64_t p = 0; p < whole; ++p) {
    if (WARM) warmer.step();
    uint32_t pair[R];
    for (int r = 0; r < R; ++r) std::memcpy(&pair[r], xr[r] + 2 * p, sizeof pair[r]);
    step(p, pair);
  }
  if (k_dim % 2) {
    if (WARM) warmer.step();
    uint32_t pair[R];
    for (int r = 0; r < R; ++r) pair[r] = xr[r][2 * whole];
    step(whole, pair);
  }
  for (int r = 0; r < R; ++r) {
    vf row[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&row[j], &acc[r][j], sizeof row[j]);
    store_row(out, m0 + r, col, row);
  }
}
#endif

#if defined(MULTISERVE_AMX_BUILT)
// kAmx: rows [m0, m0 + rows) (rows <= 16) of one panel on the tiles (amx_panel.h), then
// store_row's epilogue per row.
void block_amx(const uint16_t* x, int64_t k_dim, const uint16_t* panel, const Out& out,
               int64_t col, int64_t m0, int rows, const WarmRows& warm) {
  alignas(64) static thread_local float acc[multiserve::amx::ROWS][PANEL];
  const multiserve::amx::Ahead ahead{reinterpret_cast<const char*>(warm.rows),
                                     warm.rows == nullptr ? 0 : warm.count * PAIR_ROW * 2};
  multiserve::amx::panel_block(x + m0 * k_dim, k_dim, k_dim, panel, rows, &acc[0][0], ahead);
  for (int r = 0; r < rows; ++r) {
    vf row[NV];
    std::memcpy(row, acc[r], sizeof row);
    store_row(out, m0 + r, col, row);
  }
}
#endif

struct Problem {
  const void* x;
  bool x_bf16;
  const uint16_t* wp;  // [panels, K2, 128] of the chosen layer (dense) or [G, ...] (grouped)
  Out out;
  int64_t m, k, k2, panels;
  Path path;  // kDot only with x bfloat16 (checked by the handler)
};

template <bool WARM>
void block_rows_of(int64_t r, const Problem& pr, const uint16_t* panel, int64_t col,
                   int64_t m0, WarmRows warm) {
#if defined(MULTISERVE_AMX_BUILT)
  if (pr.path == kAmx) {
    block_amx(static_cast<const uint16_t*>(pr.x), pr.k, panel, pr.out, col, m0,
              static_cast<int>(r), warm);
    return;
  }
#endif
#define MULTISERVE_BLOCK(R)                                                              \
  case R:                                                                                \
    if (pr.path == kDot)                                                                 \
      DOT_BLOCK(R);                                                                      \
    else if (pr.x_bf16)                                                                  \
      block_widen<R, WARM>(static_cast<const uint16_t*>(pr.x), pr.k, panel, pr.out, col, \
                           m0, warm);                                                    \
    else                                                                                 \
      block_widen<R, WARM>(static_cast<const float*>(pr.x), pr.k, panel, pr.out, col,    \
                           m0, warm);                                                    \
    break;
#if defined(__AVX512BF16__)
#define DOT_BLOCK(R) \
  block_dot<R, WARM>(static_cast<const uint16_t*>(pr.x), pr.k, panel, pr.out, col, m0, warm)
#else
#define DOT_BLOCK(R) (void)0
#endif
  switch (r) {
    MULTISERVE_BLOCK(6)
    MULTISERVE_BLOCK(5)
    MULTISERVE_BLOCK(4)
    MULTISERVE_BLOCK(3)
    MULTISERVE_BLOCK(2)
    MULTISERVE_BLOCK(1)
    default: break;
  }
#undef DOT_BLOCK
#undef MULTISERVE_BLOCK
}

void block_rows(int64_t r, const Problem& pr, const uint16_t* panel, int64_t col,
                int64_t m0, WarmRows warm = {}) {
  if (warm.rows != nullptr)
    block_rows_of<true>(r, pr, panel, col, m0, warm);
  else
    block_rows_of<false>(r, pr, panel, col, m0, warm);
}

// row_gemm.cc's schedule: with two register blocks or more, every block prefetches its
// share of the next panel.
inline bool warms_next_panel(const Problem& pr) { return pr.m > block_rows_for(pr.path); }

inline int64_t blocks_of(const Problem& pr) {
  const int64_t rows = block_rows_for(pr.path);
  return (pr.m + rows - 1) / rows;
}

void run_block(const Problem& pr, int64_t p, int64_t i) {
  const uint16_t* panel = pr.wp + p * pr.k2 * PAIR_ROW;
  const int64_t blocks = blocks_of(pr);
  const int64_t share = (pr.k2 + blocks - 1) / blocks;  // next-panel rows per block
  WarmRows warm;
  if (warms_next_panel(pr) && p + 1 < pr.panels && i * share < pr.k2) {
    warm.rows = panel + (pr.k2 + i * share) * PAIR_ROW;
    warm.every = blocks;
    warm.count = std::min(share, pr.k2 - i * share);
  } else if (blocks == 1 && multiserve::product_tuning().ahead_bytes > 0) {
    // one block: the machine's `ahead_bytes` of the stream, a pair row a step (row_gemm.cc)
    warm.rows = panel + multiserve::product_tuning().ahead_bytes / sizeof(uint16_t);
    warm.count = pr.k2;
  }
  const int64_t rows = block_rows_for(pr.path), m0 = i * rows;
  block_rows(std::min<int64_t>(rows, pr.m - m0), pr, panel, p * PANEL, m0, warm);
}

// Checks shared by both handlers; fills the operand part of `pr`.
ffi::Error check(const char* name, const ffi::AnyBuffer& x, ffi::Buffer<ffi::BF16>& wp,
                 int64_t path, ffi::Result<ffi::AnyBuffer>& y, Problem& pr) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  const auto yd = y->dimensions();
  const std::string who(name);
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != PAIR_ROW || wd[2] != (xd[1] + 1) / 2 ||
      yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1] * PANEL)
    return ffi::Error::InvalidArgument(who + ": x [M, K], panels [L, N/64, ceil(K/2), 128] "
                                       "and y [M, N/64 * 64] expected");
  const auto xt = x.element_type(), yt = y->element_type();
  if ((xt != ffi::DataType::F32 && xt != ffi::DataType::BF16) ||
      (yt != ffi::DataType::F32 && yt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(who + ": x and y float32 or bfloat16 expected");
  if (path != kDot && path != kWiden && path != kAmx)
    return ffi::Error::InvalidArgument(who + ": path 0 (dot), 1 (widen) or 2 (amx) expected");
  if (path == kDot && (xt != ffi::DataType::BF16 || !dot_available()))
    return ffi::Error::InvalidArgument(who + ": the dot path needs bfloat16 x and a CPU "
                                       "with AVX512_BF16");
  if (path == kAmx && (xt != ffi::DataType::BF16 || !multiserve::amx::available()))
    return ffi::Error::InvalidArgument(who + ": the amx path needs bfloat16 x and a CPU "
                                       "and kernel that grant AMX-BF16 tiles");
  pr.x = x.untyped_data();
  pr.x_bf16 = xt == ffi::DataType::BF16;
  pr.out = Out{y->untyped_data(), yt == ffi::DataType::BF16, wd[1] * PANEL};
  pr.m = xd[0];
  pr.k = xd[1];
  pr.k2 = wd[2];
  pr.panels = wd[1];
  pr.path = static_cast<Path>(path);
  return ffi::Error::Success();
}

// The dense product of `pr` (its operands checked) with the layer `layer` of its panels.
ffi::Error run_dense(ffi::ThreadPool& pool, Problem& pr, const ffi::Buffer<ffi::BF16>& wp,
                     const ffi::Buffer<ffi::S32>& layer) {
  const auto wd = wp.dimensions();
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0])
    return ffi::Error::InvalidArgument("row_gemm_bf16: layer out of range");
  pr.wp = wp.typed_data() + l * wd[1] * wd[2] * PAIR_ROW;
  const int64_t blocks = blocks_of(pr);
  for_each_item(pool, pr.panels * blocks, work_units(pr.panels, pr.m, pr.k2),
                warms_next_panel(pr), [pr, blocks](int64_t b, int64_t e) {
                  for (int64_t u = b; u < e; ++u) run_block(pr, u / blocks, u % blocks);
                  multiserve::amx::release();
                });
  return ffi::Error::Success();
}

ffi::Error RowGemmBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> wp,
                           ffi::Buffer<ffi::S32> layer, int64_t path,
                           ffi::Result<ffi::AnyBuffer> y) {
  Problem pr;
  if (ffi::Error err = check("row_gemm_bf16", x, wp, path, y, pr); err.failure()) return err;
  return run_dense(pool, pr, wp, layer);
}

// res + x @ W, y and res bfloat16 [M, N/64 * 64] (store_row's epilogue).
ffi::Error RowGemmBf16ResidualImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::BF16> wp, ffi::Buffer<ffi::S32> layer,
                                   ffi::Buffer<ffi::BF16> res, int64_t path,
                                   ffi::Result<ffi::AnyBuffer> y) {
  Problem pr;
  if (ffi::Error err = check("row_gemm_bf16_residual", x, wp, path, y, pr); err.failure())
    return err;
  const auto rd = res.dimensions();
  const auto yd = y->dimensions();
  if (!pr.out.bf16 || rd.size() != 2 || rd[0] != yd[0] || rd[1] != yd[1])
    return ffi::Error::InvalidArgument("row_gemm_bf16_residual: y bfloat16 and res of y's "
                                       "shape [M, N/64 * 64] expected");
  pr.out.res = res.typed_data();
  return run_dense(pool, pr, wp, layer);
}

void run_grouped_panel(const Problem& pr, const int32_t* groups, int64_t p) {
  const int64_t most = block_rows_for(pr.path);
  int64_t m0 = 0;
  while (m0 < pr.m) {
    const int32_t g = groups[m0];
    int r = 1;
    while (r < most && m0 + r < pr.m && groups[m0 + r] == g) ++r;
    const uint16_t* panel = pr.wp + (g * pr.panels + p) * pr.k2 * PAIR_ROW;
    block_rows(r, pr, panel, p * PANEL, m0);
    m0 += r;
  }
}

ffi::Error GroupedRowGemmBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                  ffi::Buffer<ffi::BF16> wp, ffi::Buffer<ffi::S32> groups,
                                  int64_t path, ffi::Result<ffi::AnyBuffer> y) {
  Problem pr;
  if (ffi::Error err = check("grouped_row_gemm_bf16", x, wp, path, y, pr); err.failure())
    return err;
  const auto gd = groups.dimensions();
  if (gd.size() != 1 || gd[0] != pr.m)
    return ffi::Error::InvalidArgument("grouped_row_gemm_bf16: groups [M] expected");
  const int32_t* g = groups.typed_data();
  for (int64_t i = 0; i < pr.m; ++i)
    if (g[i] < 0 || g[i] >= wp.dimensions()[0])
      return ffi::Error::InvalidArgument("grouped_row_gemm_bf16: group out of range");
  pr.wp = wp.typed_data();
  for_each_item(pool, pr.panels, work_units(pr.panels, pr.m, pr.k2), false,
                [pr, g](int64_t b, int64_t e) {
                  for (int64_t p = b; p < e; ++p) run_grouped_panel(pr, g, p);
                  multiserve::amx::release();
                });
  return ffi::Error::Success();
}

}  // namespace

void multiserve::row_gemm_bf16_panel(const Bf16Row& row, int64_t p, Warm warm) {
  Problem pr;
  pr.x = row.x;
  pr.x_bf16 = row.x_bf16;
  pr.wp = row.panels;
  pr.out = Out{row.y, row.y_bf16, row.panels_count * PANEL, row.res};
  pr.m = 1;
  pr.k = row.k;
  pr.k2 = (row.k + 1) / 2;
  pr.panels = row.panels_count;
  pr.path = static_cast<Path>(row.path);
  WarmRows rows;  // PanelWarmer's unit: 256 bytes a step
  if (warm.start != nullptr) {
    rows.rows = static_cast<const uint16_t*>(warm.start);
    rows.count = (warm.bytes + PAIR_ROW * 2 - 1) / (PAIR_ROW * 2);
    rows.every = std::max<int64_t>(1, pr.k2 / std::max<int64_t>(1, rows.count));
    rows.to_l1 = true;
  }
  block_rows(1, pr, pr.wp + p * pr.k2 * PAIR_ROW, p * PANEL, 0, rows);
}

bool multiserve::row_gemm_bf16_dot_available() { return dot_available(); }

bool multiserve::row_gemm_bf16_amx_available() { return multiserve::amx::available(); }

void multiserve::row_gemm_bf16_release() { multiserve::amx::release(); }

// 1 where this build and CPU run the kDot path (AVX512_BF16), else 0 (kWiden only).
extern "C" int MultiserveBf16DotAvailable() { return dot_available() ? 1 : 0; }

// 1 where this build, CPU and kernel run the kAmx path (AMX-BF16 tiles granted), else 0.
extern "C" int MultiserveBf16AmxAvailable() { return multiserve::amx::available() ? 1 : 0; }

// The XLA handlers (left out of the arithmetic probes, tests/model/*_probe.cc, which
// build only the blocks).
#if !defined(MULTISERVE_KERNEL_PROBE)
XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveRowGemmBf16, RowGemmBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveRowGemmBf16Residual, RowGemmBf16ResidualImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveGroupedRowGemmBf16, GroupedRowGemmBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::AnyBuffer>());
#endif  // MULTISERVE_KERNEL_PROBE
