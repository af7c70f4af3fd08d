// The AMX path of multiserve's bfloat16 product (row_gemm_bf16.cc's kAmx): up to 16 rows of
// x against one k-pair panel (64 columns), on Intel's AMX tiles (TDPBF16PS).
//
// What one TDPBF16PS computes for an output element (measured on an Intel Xeon, family 6
// model 167, against every order of the pair products: tests/model/test_amx_product.py
// checks it wherever AMX runs): over the instruction's pairs p = 0 .. P-1 (P <= 16; a pair
// is x[2p], x[2p + 1] against W[2p, c], W[2p + 1, c]), E = the even products summed in
// order from zero and O = the odd products summed in order from zero (each step one
// rounding, to nearest even; the bfloat16 products are exact in float32), then
// C' = C + (E + O). Inputs and outputs below float32's normal range are flushed to zero.
// So an element of this path is, from C = 0, that update for each block of 16 pairs of k
// in order, the last block the pairs left over (an odd K's last pair is x[K - 1] and a
// zero against the panel's zero row): a function of its own x row and W only. Which rows
// share a tile, how many, and where a row sits in it never enter a row's sums: row
// invariance by construction, like the other two paths, with bits of its own.
//
// The tiles: C0..C3 (tmm0-3) hold the block's rows x 64 columns of float32 sums (16
// columns each); tmm4 and tmm7 blocks of x (rows x 16 pairs, in turn), tmm5 and tmm6 16
// pair rows of one 16-column group of the panel (the panel's VNNI layout is the tile's: a
// pair row of a 16-column group is 64 contiguous bytes, the panel's pair rows 256 bytes
// apart), in turn; a shorter last block is staged with zero pairs after it. A thread loads a tile
// configuration when a block needs another one than it holds (`configure`: once per work
// range at a steady shape) and releases the tiles at the end of its range (`release`: no
// tile state left for a context switch to save).

#ifndef MULTISERVE_NATIVE_AMX_PANEL_H_
#define MULTISERVE_NATIVE_AMX_PANEL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define MULTISERVE_AMX_BUILT 1
#endif

namespace multiserve::amx {

constexpr int ROWS = 16;        // rows of x per tile block
constexpr int PAIRS = 16;       // pairs of k per tile block
constexpr int64_t PAIR_ROW = 128;  // bfloat16 per panel pair row (64 columns x 2)

// Whether this build and CPU run AMX tiles, and Linux grants this process their state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA: asked once; the grant is the process's).
inline bool available() {
#if defined(MULTISERVE_AMX_BUILT) && defined(__x86_64__)
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, kGetXcompPerm, &features) != 0) return false;
    return ((features >> kXtileData) & 1ul) != 0;
  }();
  return granted;
#else
  return false;
#endif
}

#if defined(MULTISERVE_AMX_BUILT)
// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they
// read (_tile_loadd names no memory at all, _tile_loadconfig 8 of its 64 bytes): a buffer the
// CPU has just written (the configuration, the staged tail of x) is fenced with this before
// the tiles read it. And the buffers tiles load from or store to are never the stack (the
// staged tail here, the sums in row_gemm_bf16.cc's block_amx: thread_local storage): with
// both on the stack, rows of a block came out as NaN in the first calls of a process in
// XLA's threads (tests/model/test_native_kernels_bf16.py, ~1 run in 2 on an Intel Xeon,
// family 6 model 167; not reproduced in a plain C++ program).
inline void written_before_tiles_read() { asm volatile("" ::: "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct TileState {
  TileConfig cfg;
  bool loaded = false;
};
inline TileState& tile_state() {
  thread_local TileState state;
  return state;
}

// The tiles shaped for blocks of `rows` rows: C0..C3 (tmm0-3) rows x 16 float32, x blocks
// (tmm4, tmm7) rows x 16 pairs, panel blocks (tmm5, tmm6) 16 pair rows x 16 columns.
inline void configure(int rows) {
  TileConfig cfg;
  for (const int t : {0, 1, 2, 3, 4, 7}) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (const int t : {5, 6}) {
    cfg.rows[t] = PAIRS;
    cfg.colsb[t] = 64;
  }
  TileState& state = tile_state();
  if (state.loaded && std::memcmp(&state.cfg, &cfg, sizeof cfg) == 0) return;
  written_before_tiles_read();
  _tile_loadconfig(&cfg);
  state.cfg = cfg;
  state.loaded = true;
}

// The end of a thread's work range: the tiles released (if it configured them).
inline void release() {
  TileState& state = tile_state();
  if (!state.loaded) return;
  _tile_release();
  state.loaded = false;
}

// Bytes to prefetch into L2 while a block runs, spread evenly over its k blocks (the next
// panel's share, or the stream ahead: row_gemm_bf16.cc's WarmRows). Changes no arithmetic.
struct Ahead {
  const char* start = nullptr;  // nullptr: none
  int64_t bytes = 0;
};

// One block of 16 pairs: x's block loaded into tile XA, then each 16-column group of the
// panel's block into tmm5 and tmm6 in turn (two tiles: a group's load need not wait for the
// previous group's product to finish reading its tile), each times XA into its C.
#define MULTISERVE_AMX_BLOCK(XA, xs, x_stride, w, w_stride) \
  do {                                                       \
    _tile_loadd(XA, xs, x_stride);                           \
    _tile_loadd(5, w, w_stride);                             \
    _tile_dpbf16ps(0, XA, 5);                                \
    _tile_loadd(6, (w) + 32, w_stride);                      \
    _tile_dpbf16ps(1, XA, 6);                                \
    _tile_loadd(5, (w) + 64, w_stride);                      \
    _tile_dpbf16ps(2, XA, 5);                                \
    _tile_loadd(6, (w) + 96, w_stride);                      \
    _tile_dpbf16ps(3, XA, 6);                                \
  } while (0)

// acc[r * 64 + c] = row r's sums (module comment) for rows r < `rows` (<= 16) of x (bfloat16
// [rows, K], row r at x + r * ldx) against the panel's 64 columns (k-pair panel
// [ceil(K / 2), 128], row_gemm_bf16.cc's layout). The caller calls `release` at the end of
// its work range.
inline void panel_block(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* panel,
                        int rows, float* acc, Ahead ahead = {}) {
  const int64_t pairs = (k + 1) / 2;
  const int64_t full = k / (2 * PAIRS);  // blocks whose elements all lie below K
  const int64_t rest = pairs - full * PAIRS;  // pairs of the last, shorter block (0..16)
  configure(rows);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t panel_stride = PAIR_ROW * sizeof(uint16_t);
  const int64_t steps = full + (rest > 0 ? 1 : 0);
  const int64_t lines = (ahead.bytes / 64 + steps - 1) / std::max<int64_t>(1, steps);
  const char* next = ahead.start;
  const auto warm = [&next, lines] {
    if (next == nullptr) return;
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(next + 64 * l, 0, 2);
    next += 64 * lines;
  };
  int64_t b = 0;
  for (; b + 1 < full; b += 2) {  // x's blocks alternate between tmm4 and tmm7
    warm();
    MULTISERVE_AMX_BLOCK(4, x + 2 * PAIRS * b, x_stride, panel + b * PAIRS * PAIR_ROW,
                         panel_stride);
    warm();
    MULTISERVE_AMX_BLOCK(7, x + 2 * PAIRS * (b + 1), x_stride,
                         panel + (b + 1) * PAIRS * PAIR_ROW, panel_stride);
  }
  if (b < full) {
    warm();
    MULTISERVE_AMX_BLOCK(4, x + 2 * PAIRS * b, x_stride, panel + b * PAIRS * PAIR_ROW,
                         panel_stride);
  }
  if (rest > 0) {  // the last pairs of x and of the panel, staged with zero pairs after
    // them (+0 x +0: adds nothing, and no sum starts at -0, so the bits are the shorter
    // block's); an odd K's last pair is x[K - 1], 0 against the panel's zero row
    alignas(64) static thread_local uint16_t xs[ROWS][2 * PAIRS];
    alignas(64) static thread_local uint16_t ws[PAIRS][PAIR_ROW];
    std::memset(xs, 0, sizeof xs);
    std::memset(ws, 0, sizeof ws);
    const int64_t first = 2 * PAIRS * full, count = k - first;
    for (int r = 0; r < rows; ++r)
      std::memcpy(xs[r], x + r * ldx + first, count * sizeof(uint16_t));
    std::memcpy(ws, panel + full * PAIRS * PAIR_ROW, rest * PAIR_ROW * sizeof(uint16_t));
    written_before_tiles_read();
    MULTISERVE_AMX_BLOCK(7, &xs[0][0], 2 * PAIRS * sizeof(uint16_t), &ws[0][0], panel_stride);
  }
  constexpr int64_t acc_stride = 64 * sizeof(float);
  _tile_stored(0, acc, acc_stride);
  _tile_stored(1, acc + 16, acc_stride);
  _tile_stored(2, acc + 32, acc_stride);
  _tile_stored(3, acc + 48, acc_stride);
}
#undef MULTISERVE_AMX_BLOCK
#else
inline void release() {}
#endif

}  // namespace multiserve::amx

#endif  // MULTISERVE_NATIVE_AMX_PANEL_H_
