// multiserve's CPU row-invariant matrix product, an XLA FFI custom call (built and loaded
// by multiserve/model/kernels/native.py).
//
// y[M, N] = x[M, K] @ W, W given PACKED as panels wp[L, N / 64, K, 64] (panel p of layer l
// holds columns 64p .. 64p+63 of layer l's W, row k contiguous: `pack_panels`), the layer
// chosen by a scalar operand, so a scanned decoder reads its layer's weights in place
// (a slice of the stack would be copied for the call).
//
// Row invariance BY CONSTRUCTION: every y[m, n] is the sum over k = 0, 1, .., K-1 in that
// order, each step one fused multiply-add into the running sum, starting from zero; the
// tiling (6-row blocks, the last one smaller; 64-column panels; panels spread over
// threads) only decides which core computes an element and which registers hold it,
// never the order of its sum. So a row's bits do not depend on M, on the other rows or
// on the thread count. (Each step is float_ops.h's explicit `fmadd`: one FMA where the
// build has FMA, the same operation in every register block's size.)
//
// The GROUPED product (mixture-of-experts experts) is the same computation with one weight
// matrix per row: y[m] = x[m] @ W[groups[m]], W given as panels wp[G, N / 64, K, 64] (an
// expert's matrix, layers x experts flattened into G). Register blocks take up to 6
// consecutive rows of ONE group (rows come sorted by expert, so blocks are full except
// at a group's end); every element is still the in-order sum over k from zero, so a row's
// bits depend only on its own x row and its group's matrix: not on how many other rows
// chose that expert, nor where the group starts.

#include <algorithm>
#include <cstdint>
#include <cstring>

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
constexpr int NV = 4;         // vectors per panel row
constexpr int PANEL = 16 * NV;  // columns per panel
constexpr int MR = 6;         // rows per register block

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Rows of the NEXT panel to prefetch into L2 while a block runs: at every `every`-th k step
// the next of `count` panel rows from `rows` (one 256-byte panel row, 4 cache lines).
struct WarmRows {
  const float* rows = nullptr;  // nullptr: none
  int64_t every = 1, count = 0;
  bool to_l1 = false;  // prefetcht0 (row_panel.h's Warm) instead of prefetcht1
};

using multiserve::PanelWarmer;  // row_panel.h
static_assert(PANEL * sizeof(float) == multiserve::PANEL_ROW_BYTES);

#if !defined(__AVX512F__) && defined(__FMA__) && !defined(MULTISERVE_GENERIC_BLOCK)
// AVX2 + FMA (x86-64-v3) builds: 16 ymm registers, so R rows x 64 columns of accumulators
// (8 R ymm) do not fit: the panel's columns are covered in passes of `pass_ymm(R)` ymm
// (8 R-row accumulators at most 12, with at least 8 independent sums for the FMA's
// latency), each pass the whole k loop. A pass decides only which registers hold a sum:
// every element is still the sum over k from zero, one _mm256_fmadd_ps a step, which is
// float_ops.h's fmadd lane by lane, so the bits are the generic block's (and an AVX-512
// build's). The first pass warms the next panel rows (`warm`). (float_ops.h brings the
// intrinsics in FMA builds.) MULTISERVE_GENERIC_BLOCK builds the generic block instead:
// tests/model/row_gemm_probe.cc compares the two.

constexpr int pass_ymm(int r) { return r == 1 ? 8 : r <= 3 ? 4 : 2; }

template <int R, bool WARM = false>
inline void block(const float* x, int64_t k_dim, const float* panel, float* y, int64_t ldy,
                  int64_t m0, WarmRows warm = {}) {
  constexpr int C = pass_ymm(R);
  static_assert((PANEL / 8) % C == 0);
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k_dim;
  for (int c0 = 0; c0 < PANEL / 8; c0 += C) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
    PanelWarmer ws(warm);
    const float* col = panel + 8 * c0;
    for (int64_t k = 0; k < k_dim; ++k) {
      if (WARM && c0 == 0) ws.step();
      __m256 b[C];
      for (int j = 0; j < C; ++j) b[j] = _mm256_loadu_ps(col + k * PANEL + 8 * j);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xr[r] + k);
        for (int j = 0; j < C; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(y + (m0 + r) * ldy + 8 * (c0 + j), acc[r][j]);
  }
}
#else
// rows [m0, m0 + R) of one panel: R x 64 accumulators in registers, k in order
template <int R, bool WARM = false>
inline void block(const float* x, int64_t k_dim, const float* panel, float* y, int64_t ldy,
                  int64_t m0, WarmRows warm = {}) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k_dim;
  PanelWarmer ws(warm);
  for (int64_t k = 0; k < k_dim; ++k) {
    if (WARM) ws.step();
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load(panel + k * PANEL + 16 * j);
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + xr[r][k];
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    std::memcpy(y + (m0 + r) * ldy, acc[r], sizeof acc[r]);
}
#endif

struct Problem {
  const float* x;
  const float* wp;
  float* y;
  int64_t m, k, panels;
};

// Rows m0 .. m0 + r - 1 (1 <= r <= MR) of one panel: the register block of r rows. The
// blocks that warm nothing are the plain ones (no prefetch test in their k loop).
template <bool WARM>
void block_rows_of(int64_t r, const float* x, int64_t k_dim, const float* panel, float* y,
                   int64_t ldy, int64_t m0, WarmRows warm) {
  switch (r) {
    case 6: block<6, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
    case 5: block<5, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
    case 4: block<4, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
    case 3: block<3, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
    case 2: block<2, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
    default: block<1, WARM>(x, k_dim, panel, y, ldy, m0, warm); break;
  }
}

void block_rows(int64_t r, const float* x, int64_t k_dim, const float* panel, float* y,
                int64_t ldy, int64_t m0, WarmRows warm = {}) {
  if (warm.rows != nullptr)
    block_rows_of<true>(r, x, k_dim, panel, y, ldy, m0, warm);
  else
    block_rows_of<false>(r, x, k_dim, panel, y, ldy, m0, warm);
}

// One panel, its rows in register blocks of MR: the first block reads the panel from
// memory, the others from the core's caches. With two blocks or more, every block
// prefetches its share of the NEXT panel (block i of n: panel rows [i K/n, (i+1) K/n), one
// every n k steps), so the core's memory stream runs at an even rate through all of them
// instead of only during the first; at 12-16 rows this is the difference between the
// memory's time plus the cache passes' compute and their maximum. One block (up to MR rows)
// is a stream the hardware prefetcher keeps up with alone (warming there only adds work:
// docs/performance.md §3). Prefetches change no arithmetic.
// Whether run_block warms the next panel: with two register blocks or more.
inline bool warms_next_panel(int64_t m) { return m > MR; }

inline int64_t blocks_of(int64_t m) { return (m + MR - 1) / MR; }

// Register block i of panel p: rows [i MR, min((i + 1) MR, m)). One block per panel: the
// machine's `ahead_bytes` of the weight stream prefetched, a panel row a step (past the
// panel's end, the next one's in memory; a prefetch never faults).
void run_block(const Problem& pr, int64_t p, int64_t i) {
  const float* panel = pr.wp + p * pr.k * PANEL;
  const int64_t blocks = blocks_of(pr.m);
  const int64_t share = (pr.k + blocks - 1) / blocks;  // next-panel rows per block
  WarmRows warm;
  if (warms_next_panel(pr.m) && p + 1 < pr.panels && i * share < pr.k) {
    warm.rows = panel + (pr.k + i * share) * PANEL;
    warm.every = blocks;
    warm.count = std::min(share, pr.k - i * share);
  } else if (blocks == 1 && multiserve::product_tuning().ahead_bytes > 0) {
    warm.rows = panel + multiserve::product_tuning().ahead_bytes / sizeof(float);
    warm.count = pr.k;
  }
  const int64_t m0 = i * MR;
  block_rows(std::min<int64_t>(MR, pr.m - m0), pr.x, pr.k, panel, pr.y + p * PANEL,
             pr.panels * PANEL, m0, warm);
}

ffi::Error RowGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != PANEL || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("row_gemm: x [M, K] and panels [L, N/64, K, 64] "
                                       "expected");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("row_gemm: layer out of range");
  const Problem pr{x.typed_data(), wp.typed_data() + l * wd[1] * wd[2] * PANEL,
                   y->typed_data(), xd[0], xd[1], wd[1]};
  // Items are (panel, block) pairs in panel order. With warming (more than one block):
  // one contiguous run per thread, so the threads' shares differ by one block at most
  // (with whole panels, two threads split an odd panel count, as in SmolLM2's 9- and
  // 15-panel matrices, a whole panel unevenly; the panel where two runs meet is read by
  // both). One block: an item is a panel, ~4 grabs per thread.
  const int64_t blocks = blocks_of(pr.m);
  for_each_item(pool, pr.panels * blocks, work_units(pr.panels, pr.m, pr.k),
                warms_next_panel(pr.m), [pr, blocks](int64_t b, int64_t e) {
                  for (int64_t u = b; u < e; ++u) run_block(pr, u / blocks, u % blocks);
                });
  return ffi::Error::Success();
}

struct GroupedProblem {
  const float* x;
  const float* wp;  // [G, panels, K, 64]
  const int32_t* groups;  // [M], each in [0, G)
  float* y;
  int64_t m, k, panels;
};

void run_grouped_panel(const GroupedProblem& pr, int64_t p) {
  float* y = pr.y + p * PANEL;
  const int64_t ldy = pr.panels * PANEL;
  int64_t m0 = 0;
  while (m0 < pr.m) {
    const int32_t g = pr.groups[m0];
    int r = 1;
    while (r < MR && m0 + r < pr.m && pr.groups[m0 + r] == g) ++r;
    const float* panel = pr.wp + (g * pr.panels + p) * pr.k * PANEL;
    block_rows(r, pr.x, pr.k, panel, y, ldy, m0);
    m0 += r;
  }
}

ffi::Error GroupedRowGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::S32> groups,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  const auto gd = groups.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != PANEL || wd[2] != xd[1] ||
      gd.size() != 1 || gd[0] != xd[0])
    return ffi::Error::InvalidArgument("grouped_row_gemm: x [M, K], panels [G, N/64, K, 64] "
                                       "and groups [M] expected");
  const int32_t* g = groups.typed_data();
  for (int64_t i = 0; i < xd[0]; ++i)
    if (g[i] < 0 || g[i] >= wd[0])
      return ffi::Error::InvalidArgument("grouped_row_gemm: group out of range");
  const GroupedProblem pr{x.typed_data(), wp.typed_data(), g, y->typed_data(), xd[0], xd[1],
                          wd[1]};
  for_each_item(pool, pr.panels, work_units(pr.panels, pr.m, pr.k), false,
                [pr](int64_t b, int64_t e) {
                  for (int64_t p = b; p < e; ++p) run_grouped_panel(pr, p);
                });
  return ffi::Error::Success();
}

}  // namespace

// The machine's product tuning (product_split.h), set by native.py before any product runs.
extern "C" void MultiserveSetProductTuning(int64_t split_units, int64_t ahead_bytes) {
  multiserve::product_tuning().split_units = split_units;
  multiserve::product_tuning().ahead_bytes = ahead_bytes;
}

void multiserve::row_gemm_panel(const float* x, int64_t k, const float* panels, int64_t p,
                                float* y, const float* res, Warm warm) {
  const float* panel = panels + p * k * PANEL;
  if (warm.start == nullptr) {
    block<1>(x, k, panel, y + p * PANEL, 0, 0);
  } else {  // WarmRows' unit: 256 bytes a step
    WarmRows rows;
    rows.rows = static_cast<const float*>(warm.start);
    rows.count = (warm.bytes + PANEL * 4 - 1) / (PANEL * 4);
    rows.every = std::max<int64_t>(1, k / std::max<int64_t>(1, rows.count));
    rows.to_l1 = true;
    block<1, true>(x, k, panel, y + p * PANEL, 0, 0, rows);
  }
  if (res == nullptr) return;
  for (int64_t c = p * PANEL; c < (p + 1) * PANEL; ++c) y[c] = res[c] + y[c];
}

// The XLA handlers (left out of the arithmetic probes, tests/model/*_probe.cc, which
// build only the blocks).
#if !defined(MULTISERVE_KERNEL_PROBE)
XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveGroupedRowGemm, GroupedRowGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveRowGemm, RowGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif  // MULTISERVE_KERNEL_PROBE
