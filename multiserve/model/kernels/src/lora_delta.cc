// multiserve's CPU LoRA delta, an XLA FFI custom call (built and loaded by
// multiserve/model/kernels/native.py, called by multiserve/model/layers/lora.py).
//
// delta[t, :] = ((x[t] @ A[layer, s]) @ B[layer, s]) * scale[s] with s = slots[t], for
// x [T, K], the adapter stacks a [L, S, K, R] and b [L, S, R, N] (read in place: the layer
// is a scalar operand, as in row_gemm.cc), scale [S] and slots [T]; float32 out [T, N].
// x, a and b are all float32 or all bfloat16; every sum is float32 (bfloat16 products
// are exact in float32). A token of slot 0 (no adapter) gets a zero row and costs nothing; a token
// reads only its own slot's matrices (the per-token gathered product: a step with one
// adapter in use reads one adapter, whatever the slot count).
//
// The APPLIED form (MultiserveLoraApply, what the forward calls): the deltas of every
// projection of the same x at once (a layer's q, k, v; or gate, up; or o; or down), each
// added in place to ITS columns of one output y [T, W] (an operand aliased to the result:
// the fused product's output whole, projection m at column offsets[m], an attribute), so
// no projection's columns are copied into a buffer of their own: for a token with an
// adapter, y'[t, c] = round(float(y[t, c]) + d[t, n]) for c = offsets[m] + n (d
// materialized in float32 first, then one float32 add, rounded once to y's dtype, to
// nearest even); a token of slot 0, and a column no projection covers, is not touched,
// so its y' is y's bits exactly. One call a layer position.
//
// Work: the tokens with an adapter sorted by slot, in runs of one slot; one item per
// (run, projection), spread over the pool (one hand-off a call): the shrink of every token
// of the run (register blocks of up to 8 tokens, each A row loaded once for the block; A
// read from memory once per item), then the expand tile by tile (256 columns; a run of
// several tokens first copies its slot's B whole into a float32 stage, one sequential
// read from memory, and its blocks read the stage from cache). So a step reads each
// adapter in use once per projection, whatever its token count.
//
// Row invariance BY CONSTRUCTION: xa[j] = sum over k = 0, 1, .., K-1 in that order of
// x[t, k] * A[k, j], one fused multiply-add per step into a running sum from zero (in
// bfloat16: pairs of k, in four chains of fixed extent combined in a fixed order, see
// shrink_bf16; the order is still a function of K alone); then
// d[n] = sum over j = 0, .., R-1 in order of xa[j] * B[j, n] the same way; then one
// multiply by the scale. Runs, blocks, tiles and threads only decide which core and which
// registers hold a token's sums, never their order. So a token's delta depends only on
// its x row, its slot's A, B and scale: not on T, on the other tokens or their adapters,
// nor on the thread count. (Built with -ffp-contract=fast: `acc += a * b` is one FMA, in
// the vector and the scalar loops alike, so the vector path (R a multiple of 16) and the
// scalar one give the same bits.)

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "product_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using multiserve::for_each_item;

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
constexpr int LANES = 16;

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline vf splat(float v) {  // every lane v's bits (one broadcast, no add)
  return vf{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v};
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// One projection of a call: its adapter stacks' layer and where its columns lie in y / d.
template <typename E>
struct Module {
  const E* a;      // [S, K, R] of the chosen layer
  const E* b;      // [S, R, N] of the chosen layer
  int64_t n;       // its columns
  int64_t offset;  // its first column in the output rows
};

// One call: the projections of one x, the tokens with an adapter sorted by slot, and the
// runs of one slot among them.
template <typename E>
struct Problem {
  const E* x;            // [T, K]
  const float* scale;    // [S]
  const int32_t* slots;  // [T]
  float* d;              // [T, width] float32 (the delta form), or nullptr (applied form)
  E* y;                  // the applied form: [T, width] of x's type, d added in place
  int64_t k, r, width;
  std::vector<Module<E>> modules;
  std::vector<int64_t> tok;                       // active tokens, by slot then position
  std::vector<std::pair<int64_t, int64_t>> runs;  // (start, count) in tok: one slot each
  std::vector<float> xa;  // [tok, modules, 64]: each active token's x @ A of each module
  float* xa_of(int64_t i, size_t m) { return xa.data() + (i * modules.size() + m) * 64; }
};

// d materialized as computed: the compiler may not contract the scale's multiply with
// the add that follows (an FMA would round once where this rounds twice)
inline void materialize(vf& v) { asm("" : "+v"(v)); }
inline void materialize(float& v) { asm("" : "+x"(v)); }

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return widen(v); }
inline void from_float(float v, float* out) { *out = v; }
inline void from_float(float v, uint16_t* out) {  // round to nearest even (no NaN here)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *out = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store(vf v, float* out) { std::memcpy(out, &v, sizeof v); }
inline void store(vf v, uint16_t* out) {  // 16 lanes, each rounded as from_float does
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vh h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vh);
  std::memcpy(out, &h, sizeof h);
}

// Columns [c, c + 16) of token t (c counted in the output row): d = acc * scale, stored
// (delta form) or added to y (one float32 add, rounded once to y's type).
template <typename E>
inline void store16(const Problem<E>& pr, int64_t t, int64_t c, vf acc, float sc) {
  vf d = acc * sc;
  materialize(d);
  if (pr.d != nullptr) {
    store(d, pr.d + t * pr.width + c);
    return;
  }
  E* y = pr.y + t * pr.width + c;
  store(load(y) + d, y);
}

template <typename E>
inline void store1(const Problem<E>& pr, int64_t t, int64_t c, float acc, float sc) {
  float d = acc * sc;
  materialize(d);
  if (pr.d != nullptr) {
    pr.d[t * pr.width + c] = d;
    return;
  }
  E* y = pr.y + t * pr.width + c;
  from_float(to_float(*y) + d, y);
}

// The shrink of NT tokens of one slot (tok[0..NT)): xa = x @ A[slot] of module m, RV
// vectors of 16 ranks each (each A row loaded once for all of them).
template <typename E, int RV, int NT>
void shrink_vec(Problem<E>& pr, size_t m, int64_t first) {
  const int64_t* tok = pr.tok.data() + first;
  const E* ar = pr.modules[m].a + pr.slots[tok[0]] * pr.k * pr.r;
  const E* xr[NT];
  for (int i = 0; i < NT; ++i) xr[i] = pr.x + tok[i] * pr.k;
  vf acc[NT][RV];
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = vf{};
  for (int64_t k = 0; k < pr.k; ++k) {
    vf av[RV];
    for (int v = 0; v < RV; ++v) av[v] = load(ar + k * pr.r + LANES * v);
    for (int i = 0; i < NT; ++i) {
      const vf xv = splat(widen(xr[i][k]));
      for (int v = 0; v < RV; ++v) acc[i][v] += xv * av[v];
    }
  }
  for (int i = 0; i < NT; ++i) std::memcpy(pr.xa_of(first + i, m), acc[i], sizeof acc[i]);
}

// The same sums one element at a time (any R up to 64).
template <typename E>
void shrink_scalar(Problem<E>& pr, size_t m, int64_t first, int count) {
  for (int64_t i = first; i < first + count; ++i) {
    const E* xr = pr.x + pr.tok[i] * pr.k;
    const E* ar = pr.modules[m].a + pr.slots[pr.tok[i]] * pr.k * pr.r;
    float* xa = pr.xa_of(i, m);
    for (int64_t j = 0; j < pr.r; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < pr.k; ++k) acc += widen(xr[k]) * widen(ar[k * pr.r + j]);
      xa[j] = acc;
    }
  }
}

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
inline vf dot_pairs(vf acc, pairs_t a, pairs_t x) {
  return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), a, x));
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
  acc += a.odd * x.odd;
  return acc + a.even * x.even;
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

template <int RV, int NT>
void shrink_bf16(Problem<uint16_t>& pr, size_t m, int64_t first) {
  const int64_t* tok = pr.tok.data() + first;
  const uint16_t* ar = pr.modules[m].a + pr.slots[tok[0]] * pr.k * pr.r;
  const uint16_t* xr[NT];
  for (int i = 0; i < NT; ++i) xr[i] = pr.x + tok[i] * pr.k;
  lane_mask lanes[RV];
  for (int v = 0; v < RV; ++v) {
    const int64_t n = std::min<int64_t>(LANES, pr.r - LANES * v);
    lanes[v] = static_cast<lane_mask>((1u << n) - 1u);
  }
  // chains stepped together: up to 8 sums in registers (a block with more runs its chains
  // one at a time); which chains step together never changes a chain's sum
  constexpr int G = NT * RV <= 2 ? 4 : NT * RV <= 4 ? 2 : 1;
  vf part[CHAINS][NT][RV];
  for (int c0 = 0; c0 < CHAINS; c0 += G)
    shrink_chains<RV, NT, G>(xr, ar, pr.k, pr.r, lanes, c0, part);
  static_assert(CHAINS == 4, "the combination below is of four chains");
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < RV; ++v) {
      const vf sum = (part[0][i][v] + part[1][i][v]) + (part[2][i][v] + part[3][i][v]);
      std::memcpy(pr.xa_of(first + i, m) + LANES * v, &sum, sizeof sum);
    }
}

template <typename E, int NT>
void shrink_block(Problem<E>& pr, size_t m, int64_t first) {
  if constexpr (std::is_same_v<E, uint16_t>) {
    switch ((pr.r + LANES - 1) / LANES) {
      case 1: shrink_bf16<1, NT>(pr, m, first); break;
      case 2: shrink_bf16<2, NT>(pr, m, first); break;
      case 3: shrink_bf16<3, NT>(pr, m, first); break;
      default: shrink_bf16<4, NT>(pr, m, first); break;
    }
    return;
  }
  switch (pr.r % LANES == 0 ? pr.r / LANES : 0) {
    case 1: shrink_vec<E, 1, NT>(pr, m, first); break;
    case 2: shrink_vec<E, 2, NT>(pr, m, first); break;
    case 3: shrink_vec<E, 3, NT>(pr, m, first); break;
    case 4: shrink_vec<E, 4, NT>(pr, m, first); break;
    default: shrink_scalar<E>(pr, m, first, NT); break;
  }
}

// Where an expand reads B[slot] of one projection: element (j, c) at p[j * stride + c -
// col0] (the stack itself, or a tile of it staged in float32)
template <typename S>
struct BRows {
  const S* p;
  int64_t stride, col0;
  const S* at(int64_t j, int64_t c) const { return p + j * stride + (c - col0); }
};

// The expand of NT tokens of one slot over CV * 16 columns from column n0 of module m:
// d = (xa @ B[slot]) * scale (each B row's CV vectors loaded once for all NT tokens).
template <typename E, typename S, int NT, int CV>
void expand_vec(Problem<E>& pr, size_t m, int64_t first, int64_t n0, const BRows<S>& rows) {
  const Module<E>& mod = pr.modules[m];
  const int64_t* tok = pr.tok.data() + first;
  const int32_t s = pr.slots[tok[0]];
  const S* br = rows.at(0, n0);
  const float* xa[NT];
  for (int i = 0; i < NT; ++i) xa[i] = pr.xa_of(first + i, m);
  vf acc[NT][CV];
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < CV; ++v) acc[i][v] = vf{};
  for (int64_t j = 0; j < pr.r; ++j) {
    vf bv[CV];
    for (int v = 0; v < CV; ++v) bv[v] = load(br + j * rows.stride + LANES * v);
    for (int i = 0; i < NT; ++i) {
      const vf xv = splat(xa[i][j]);
      for (int v = 0; v < CV; ++v) acc[i][v] += xv * bv[v];
    }
  }
  const float sc = pr.scale[s];
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < CV; ++v) store16(pr, tok[i], mod.offset + n0 + LANES * v, acc[i][v], sc);
}

// Columns [n0, n1) of module m for NT tokens: 16-column vectors CV at a time (NT * CV
// accumulators: 16 of them), then one vector, then one column at a time.
template <typename E, typename S, int NT>
void expand_block(Problem<E>& pr, size_t m, int64_t first, int64_t n0, int64_t n1,
                  const BRows<S>& rows) {
  constexpr int CV = 16 / NT;
  int64_t n = n0;
  for (; n + CV * LANES <= n1; n += CV * LANES)
    expand_vec<E, S, NT, CV>(pr, m, first, n, rows);
  for (; n + LANES <= n1; n += LANES) expand_vec<E, S, NT, 1>(pr, m, first, n, rows);
  if (n == n1) return;
  const Module<E>& mod = pr.modules[m];
  for (int64_t i = first; i < first + NT; ++i) {
    const int32_t s = pr.slots[pr.tok[i]];
    const float* xa = pr.xa_of(i, m);
    for (int64_t c = n; c < n1; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < pr.r; ++j) acc += xa[j] * widen(*rows.at(j, c));
      store1(pr, pr.tok[i], mod.offset + c, acc, pr.scale[s]);
    }
  }
}

// A run's tokens in register blocks of 8, 4, 2, 1: f(first, NT) per block.
template <typename F>
void in_blocks(int64_t first, int64_t count, F f) {
  while (count > 0) {
    const int nt = count >= 8 ? 8 : count >= 4 ? 4 : count >= 2 ? 2 : 1;
    f(first, nt);
    first += nt;
    count -= nt;
  }
}

constexpr int64_t TILE = 256;  // columns of B expanded at a time (a tile's B stays in L1)

// The expand of a run's tokens over columns [c0, c1) of module m, B read through `rows`.
template <typename E, typename S>
void expand_tile(Problem<E>& pr, int64_t start, int64_t count, size_t m, int64_t c0,
                 int64_t c1, const BRows<S>& rows) {
  in_blocks(start, count, [&pr, m, c0, c1, &rows](int64_t first, int nt) {
    switch (nt) {
      case 8: expand_block<E, S, 8>(pr, m, first, c0, c1, rows); break;
      case 4: expand_block<E, S, 4>(pr, m, first, c0, c1, rows); break;
      case 2: expand_block<E, S, 2>(pr, m, first, c0, c1, rows); break;
      default: expand_block<E, S, 1>(pr, m, first, c0, c1, rows); break;
    }
  });
}

// One item: a run of tokens of one slot and one projection: the shrink of every token
// of the run (A read once), then the expand tile by tile. A run of several tokens first
// stages its slot's B [R, N] whole in float32 (read in order from memory, one stream,
// each element widened once); its register blocks then read the stage from cache. One
// token reads B where it lies. The stage holds B's exact values, so which way a run goes
// never changes a sum.
template <typename E>
void run_item(Problem<E>& pr, int64_t start, int64_t count, size_t m) {
  in_blocks(start, count, [&pr, m](int64_t first, int nt) {
    switch (nt) {
      case 8: shrink_block<E, 8>(pr, m, first); break;
      case 4: shrink_block<E, 4>(pr, m, first); break;
      case 2: shrink_block<E, 2>(pr, m, first); break;
      default: shrink_block<E, 1>(pr, m, first); break;
    }
  });
  const Module<E>& mod = pr.modules[m];
  const E* b = mod.b + pr.slots[pr.tok[start]] * pr.r * mod.n;
  if (count == 1) {
    for (int64_t c0 = 0; c0 < mod.n; c0 += TILE)
      expand_tile(pr, start, count, m, c0, std::min(c0 + TILE, mod.n), BRows<E>{b, mod.n, 0});
    return;
  }
  thread_local std::vector<float> stage;
  stage.resize(pr.r * mod.n);
  float* st = stage.data();
  for (int64_t i = 0; i < pr.r * mod.n; i += 32) {
    __builtin_prefetch(b + i + PREFETCH);
    for (int64_t e = i; e < std::min(i + 32, pr.r * mod.n); ++e) st[e] = widen(b[e]);
  }
  for (int64_t c0 = 0; c0 < mod.n; c0 += TILE)
    expand_tile(pr, start, count, m, c0, std::min(c0 + TILE, mod.n),
                BRows<float>{st, mod.n, 0});
}

// Every projection's deltas for the active tokens: one item per (run of one slot,
// projection), spread over the pool (one hand-off a call).
template <typename E>
void run(ffi::ThreadPool& pool, Problem<E>& pr) {
  if (pr.tok.empty()) return;
  const int64_t nm = static_cast<int64_t>(pr.modules.size());
  const int64_t nr = static_cast<int64_t>(pr.runs.size());
  pr.xa.assign(pr.tok.size() * pr.modules.size() * 64, 0.0f);
  int64_t cols = 0;
  for (const auto& mod : pr.modules) cols += mod.n;
  const int64_t tokens = static_cast<int64_t>(pr.tok.size());
  // ~ multiply-adds / 64 (the unit of product_split.h), plus the A and B bytes read / 64
  const int64_t units =
      (tokens * (nm * pr.k * pr.r + cols * pr.r)) / 64 +
      nr * (nm * pr.k + cols) * pr.r * static_cast<int64_t>(sizeof(E)) / 64;
  for_each_item(pool, nr * nm, units, false, [&pr, nm](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it)
      run_item(pr, pr.runs[it / nm].first, pr.runs[it / nm].second,
               static_cast<size_t>(it % nm));
  });
}

// The tokens with an adapter, by slot (then position), and the runs of one slot among
// them (error: a slot out of [0, slots)).
template <typename E>
ffi::Error active_tokens(Problem<E>& pr, int64_t t_dim, int64_t s_dim) {
  pr.tok.reserve(t_dim);
  for (int64_t t = 0; t < t_dim; ++t) {
    if (pr.slots[t] < 0 || pr.slots[t] >= s_dim)
      return ffi::Error::InvalidArgument("lora: slot out of range");
    if (pr.slots[t] != 0) pr.tok.push_back(t);
  }
  const int32_t* slots = pr.slots;
  std::stable_sort(pr.tok.begin(), pr.tok.end(),
                   [slots](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  const int64_t count = static_cast<int64_t>(pr.tok.size());
  for (int64_t i = 0; i < count;) {
    int64_t size = 1;
    while (i + size < count && slots[pr.tok[i + size]] == slots[pr.tok[i]]) ++size;
    pr.runs.emplace_back(i, size);
    i += size;
  }
  return ffi::Error::Success();
}

// a [L, S, K, R <= 64] and b [L, S, R, N] of one projection, against x [T, K], scale [S]
bool shapes_fit(const ffi::AnyBuffer& x, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                int64_t s_dim) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  return xd.size() == 2 && ad.size() == 4 && bd.size() == 4 && ad[0] == bd[0] &&
         ad[1] == bd[1] && ad[1] == s_dim && ad[2] == xd[1] && ad[3] == bd[2] &&
         ad[3] <= 64 && a.element_type() == x.element_type() &&
         b.element_type() == x.element_type();
}

// The projection (a, b) at `layer`, its columns from `offset`.
template <typename E>
Module<E> module_of(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, int64_t layer,
                    int64_t offset) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  return Module<E>{static_cast<const E*>(a.untyped_data()) + layer * ad[1] * ad[2] * ad[3],
                   static_cast<const E*>(b.untyped_data()) + layer * bd[1] * bd[2] * bd[3],
                   bd[3], offset};
}

template <typename E>
ffi::Error delta(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                 const ffi::AnyBuffer& b, const float* scale, const int32_t* slots,
                 int64_t layer, float* out) {
  const auto xd = x.dimensions();
  const int64_t s_dim = a.dimensions()[1], n = b.dimensions()[3];
  Problem<E> pr{static_cast<const E*>(x.untyped_data()), scale, slots, out, nullptr,
                xd[1], a.dimensions()[3], n, {module_of<E>(a, b, layer, 0)}, {}, {}, {}};
  if (auto err = active_tokens(pr, xd[0], s_dim); !err.success()) return err;
  for (int64_t t = 0; t < xd[0]; ++t)
    if (slots[t] == 0) std::memset(out + t * n, 0, n * sizeof(float));
  run(pool, pr);
  return ffi::Error::Success();
}

ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer,
                         ffi::ResultBuffer<ffi::F32> d) {
  const auto xd = x.dimensions(), td = slots.dimensions(), dd = d->dimensions();
  const int64_t s_dim = scale.dimensions()[0];
  const auto et = x.element_type();
  if (!shapes_fit(x, a, b, s_dim) || td.size() != 1 || td[0] != xd[0] || dd.size() != 2 ||
      dd[0] != xd[0] || dd[1] != b.dimensions()[3] ||
      (et != ffi::DataType::F32 && et != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("lora_delta: x [T, K], a [L, S, K, R <= 64], "
                                       "b [L, S, R, N] (all float32 or all bfloat16), "
                                       "scale [S], slots [T] expected");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= a.dimensions()[0])
    return ffi::Error::InvalidArgument("lora_delta: layer out of range");
  if (et == ffi::DataType::F32)
    return delta<float>(pool, x, a, b, scale.typed_data(), slots.typed_data(), l,
                        d->typed_data());
  return delta<uint16_t>(pool, x, a, b, scale.typed_data(), slots.typed_data(), l,
                         d->typed_data());
}

template <typename E>
ffi::Error apply(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const int32_t* slots,
                 const float* scale, int64_t s_dim, int64_t layer, void* y, int64_t width,
                 const ffi::RemainingArgs& rest, ffi::Span<const int64_t> offsets) {
  const auto xd = x.dimensions();
  Problem<E> pr{static_cast<const E*>(x.untyped_data()), scale, slots, nullptr,
                static_cast<E*>(y), xd[1], 0, width, {}, {}, {}, {}};
  for (size_t m = 0; m < offsets.size(); ++m) {
    auto a = rest.get<ffi::AnyBuffer>(2 * m);
    auto b = rest.get<ffi::AnyBuffer>(2 * m + 1);
    if (!a.has_value() || !b.has_value())
      return ffi::Error::InvalidArgument("lora_apply: buffers expected");
    if (!shapes_fit(x, *a, *b, s_dim) || layer < 0 || layer >= a->dimensions()[0] ||
        offsets[m] < 0 || offsets[m] + b->dimensions()[3] > width ||
        (m > 0 && a->dimensions()[3] != pr.r))
      return ffi::Error::InvalidArgument("lora_apply: projection shapes or types differ, "
                                         "or its columns fall outside y");
    pr.r = a->dimensions()[3];
    pr.modules.push_back(module_of<E>(*a, *b, layer, offsets[m]));
  }
  if (auto err = active_tokens(pr, xd[0], s_dim); !err.success()) return err;
  run(pool, pr);
  return ffi::Error::Success();
}

// x, slots, scale, layer, y, then (a, b) per projection, its first column in y from
// `offsets`; the result: y with every delta added (y aliased to it).
ffi::Error LoraApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                         ffi::AnyBuffer y, ffi::RemainingArgs rest,
                         ffi::Result<ffi::AnyBuffer> out,
                         ffi::Span<const int64_t> offsets) {
  const auto xd = x.dimensions(), td = slots.dimensions(), yd = y.dimensions();
  const int64_t s_dim = scale.dimensions()[0];
  const auto et = x.element_type();
  if (td.size() != 1 || td[0] != xd[0] || rest.size() != 2 * offsets.size() ||
      offsets.size() == 0 || (et != ffi::DataType::F32 && et != ffi::DataType::BF16) ||
      yd.size() != 2 || yd[0] != xd[0] || y.element_type() != et ||
      out->element_type() != et || out->untyped_data() != y.untyped_data())
    return ffi::Error::InvalidArgument("lora_apply: x [T, K] (float32 or bfloat16), "
                                       "slots [T], scale [S], layer, y [T, W] aliased to "
                                       "the result, then (a, b) per offset");
  const int64_t l = layer.typed_data()[0];
  if (et == ffi::DataType::F32)
    return apply<float>(pool, x, slots.typed_data(), scale.typed_data(), s_dim, l,
                        out->untyped_data(), yd[1], rest, offsets);
  return apply<uint16_t>(pool, x, slots.typed_data(), scale.typed_data(), s_dim, l,
                         out->untyped_data(), yd[1], rest, offsets);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveLoraDelta, LoraDeltaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveLoraApply, LoraApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("offsets"));
