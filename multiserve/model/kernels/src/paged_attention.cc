// multiserve's CPU paged attention, an XLA FFI custom call (built and loaded by
// multiserve/model/kernels/native.py; the pure-JAX paged_attention is the reference
// formulation everywhere else).
//
// out[t, h*G + g, :] = softmax(score(q[t, h*G + g, :] . K_s[lo..p] * scale)) V_s[lo..p] for
// every token t of sequence s = token_seq[t] at position p = positions[t], K/V read in place
// from the paged pool [L, KV, slots, HD] through the page table (no gathered copy), where
// - lo = max(0, p - window + 1) for a sliding-window layer (window > 0), else 0: a window
//   layer visits only the key blocks of its window (the pages before it are never read);
// - score(s) = s, or softcap * tanh(s / softcap) where softcap > 0 (Gemma 2);
// - with attention sinks (GPT-OSS) head h's softmax also has one logit sinks[h] in its
//   denominator and no value: the online softmax starts from (max = sinks[h], sum = 1)
//   instead of (MASK, 0).
// The pool is
// float32 (MultiservePagedAttention) or bfloat16 (MultiservePagedAttentionBf16: each K/V
// element widened to float32 in registers, exactly; q, out, the softmax and every sum stay
// float32), one code for both. The two differ only in which head_dim elements share a
// lane of a score's partial sum (`Row`: a bf16 row is widened as even and odd dims), so
// their bits may differ by an ulp of a score; each is row-invariant by the construction
// below.
//
// Row invariance BY CONSTRUCTION (the engine's determinism rests on it): one work item is
// one (token, KV head) pair; each of its query heads is computed by the same code in the
// same order whatever else the step holds, whichever thread runs it:
//   - keys are visited in blocks of KEY_BLOCK positions aligned to position 0, up to p;
//   - a score is a 16-lane partial sum over head_dim, lanes combined in a fixed tree;
//   - each block is one online-softmax update (max, rescale, sum of exps in key order,
//     then the weighted values in key order);
//   - no reduction crosses items, and nothing depends on T, on the chunking, or on how
//     many threads ran.
// A row's window, sink and cap are its own inputs (the layer's), so they change which keys
// and which terms its computation has, never how another row computes.
// Every multiply-add is float_ops.h's explicit `fmadd` (one FMA where the build has FMA);
// the build fuses nothing else (-ffp-contract=off) and never reorders (no -ffast-math),
// so the bits are a function of the source, the instruction set and the row's own inputs
// only.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "float_ops.h"
#include "lanes16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int KEY_BLOCK = 16;  // keys per online-softmax update (= lanes of one F16)
constexpr float MASK = -1e30f;

// 16 lanes (lanes16.h: one zmm on AVX-512, two ymm on AVX; the lanes never mix except in
// lanes16.h's fixed trees and data movements).
using multiserve::float_ops::fmadd;  // the scalar one
using namespace multiserve::lanes16;

// exp's range reduction for x <= 0 (arguments below -104 clamped there): x = n ln2 + r,
// n = round(x / ln2), r in [-ln2/2, ln2/2], and 2^n as a float's bits.
struct ExpParts {
  I16 n;
  F16 r, scale;
};
inline ExpParts exp_reduce(F16 x) {
  const F16 lo = select(less(x, splat(-104.0f)), splat(-104.0f), x);
  const F16 t = fmadd(lo, splat(1.44269504088896341f), splat(0.5f));  // n = floor(t)
  const I16 tr = truncate(t);                     // truncation toward 0
  const I16 n = tr + less(t, to_float(tr));       // a true lane is -1
  const F16 nf = to_float(n);
  // r = lo - n ln2, ln2 in two parts (Cody-Waite), each step one fused multiply-add
  const F16 r = fmadd(-nf, splat(1.428606765330187e-06f),
                      fmadd(-nf, splat(0.693145751953125f), lo));
  return {n, r, as_float((n + 127) << 23)};
}

// exp(x) lane-wise for x <= 0 (every argument here is s - max): 2^n * P(r), P the degree-7
// Taylor polynomial (relative error < 1e-8, below fp32's rounding); arguments below -104
// give exactly 0 (so masked keys weigh nothing).
inline F16 exp_nonpositive(F16 x) {
  const ExpParts e = exp_reduce(x);
  F16 p = splat(1.0f / 5040.0f);  // Horner, one fused multiply-add a degree
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                        1.0f})
    p = fmadd(p, e.r, splat(c));
  return select(less(e.n, splat_i(-126)), F16{}, p * e.scale);
}

// expm1(x) lane-wise for x <= 0: exp's reduction, and where n = 0 (|x| < ln2/2) the
// polynomial's r * (1 + r/2 + r^2/6 + ...) directly, so that a small |x| keeps its
// relative precision (2^n P(r) - 1 would cancel); arguments below -104 give -1.
inline F16 expm1_nonpositive(F16 x) {
  const ExpParts e = exp_reduce(x);
  F16 q = splat(1.0f / 5040.0f);  // (P(r) - 1) / r by Horner
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f})
    q = fmadd(q, e.r, splat(c));
  const F16 small = q * e.r;  // P(r) - 1
  const F16 big = fmadd(small + 1.0f, e.scale, splat(-1.0f));  // 2^n P(r) - 1
  return select(equal(e.n, splat_i(0)), small,
                select(less(e.n, splat_i(-126)), splat(-1.0f), big));
}

// tanh(x) lane-wise: sign(x) * (-e) / (2 + e), e = expm1(-2|x|) (branch-free; odd by
// construction)
inline F16 tanh_lanes(F16 x) {
  const I16 negative = less(x, F16{});
  const F16 ax = select(negative, -x, x);
  const F16 e = expm1_nonpositive(F16{} - ax * 2.0f);
  const F16 t = -e / (e + 2.0f);
  return select(negative, -t, t);
}

// A K/V row of HD elements as HD/16 float32 vectors, in the kernel's DIMENSION ORDER
// (`Row<KV, HD>`): q, the value accumulators and the scores' lane partial sums all use it,
// and the output is written back in natural order. float32 rows: vector i holds dims
// 16i..16i+15. bfloat16 rows: each 32-dim pair of vectors is widened from one 64-byte load
// of 16 32-bit words, each word two bf16 (dims 2l, 2l+1 of the pair): vector 2c holds the
// even dims (the word shifted left 16), vector 2c+1 the odd ones (the word's high half
// masked): two integer operations per 32 dims instead of four. A trailing 16 dims (HD not a
// multiple of 32) load in natural order. The order is fixed per HD: a row's bits never
// depend on anything else.
template <typename KV, int HD>
struct Row {
  static constexpr int V = HD / 16;
  static constexpr int PAIRS = std::is_same_v<KV, uint16_t> ? HD / 32 : 0;

  static inline void load_row(const KV* p, F16 (&out)[V]) {
    if constexpr (PAIRS == 0) {
      for (int i = 0; i < V; ++i) out[i] = load(p + 16 * i);
    } else {
      for (int c = 0; c < PAIRS; ++c) {
        const I16 u = load_words(p + 32 * c);
        out[2 * c] = as_float(u << 16);
        out[2 * c + 1] = as_float(u & splat_i(static_cast<int32_t>(0xFFFF0000u)));
      }
      for (int i = 2 * PAIRS; i < V; ++i) out[i] = load(p + 16 * i);
    }
  }

  // float32 values in natural order -> the kernel's order (q)
  static inline void permute(const float* p, F16 (&out)[V]) {
    for (int c = 0; c < PAIRS; ++c)
      deinterleave(load(p + 32 * c), load(p + 32 * c + 16), out[2 * c], out[2 * c + 1]);
    for (int i = 2 * PAIRS; i < V; ++i) out[i] = load(p + 16 * i);
  }

  // the kernel's order -> natural order, stored at p (the output)
  static inline void store_row(const F16 (&in)[V], float* p) {
    for (int c = 0; c < PAIRS; ++c) {
      F16 lo, hi;
      interleave(in[2 * c], in[2 * c + 1], lo, hi);
      store(lo, p + 32 * c);
      store(hi, p + 32 * c + 16);
    }
    for (int i = 2 * PAIRS; i < V; ++i) store(in[i], p + 16 * i);
  }
};

// KV: the pool's element, float (float32) or uint16_t (bfloat16 bits)
template <typename KV>
struct Problem {
  const float* q;       // [T, H, HD]
  const KV* k;          // [L, KV, S, HD]
  const KV* v;
  float* out;           // [T, H, HD]
  const int32_t* pos;   // [T]
  const int32_t* seq;   // [T]
  const int32_t* table; // [B, max_pages]
  int64_t tokens, heads, kv_heads, group, head_dim, slots, batch, max_pages;
  int64_t layer, page_size;
  float scale;
  int64_t window;       // > 0: the layer's sliding window (keys p - window + 1 .. p)
  const float* sinks;   // [H] the layer's sink logits, or nullptr (no sinks)
  float softcap;        // > 0: scores capped as softcap * tanh(s / softcap)
};

// The first key position of a query at position p (its window's first key, or 0).
inline int64_t first_key(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
}

// The pool slot of key position `key` of a sequence whose page table row is `pages`.
inline int64_t slot_of(const int32_t* pages, int64_t key, int64_t page_size) {
  return int64_t{pages[key / page_size]} * page_size + key % page_size;
}

// The slots of one key block [b0, b0 + KEY_BLOCK) (b0 a multiple of KEY_BLOCK): where the
// page size is a multiple of KEY_BLOCK the block lies in one page, so its slots are
// consecutive from the first one (one division per block instead of one per key).
struct BlockSlots {
  const int32_t* pages;
  int64_t page_size, b0, first;
  bool one_page;
  BlockSlots(const int32_t* p, int64_t ps, int64_t b)
      : pages(p), page_size(ps), b0(b), first(0), one_page(ps % KEY_BLOCK == 0) {
    if (one_page) first = slot_of(pages, b0, page_size);
  }
  inline int64_t operator()(int j) const {
    return one_page ? first + j : slot_of(pages, b0 + j, page_size);
  }
};

// What an item warms while it runs: the K and V rows, at the keys it visits, of the
// (token, KV head) pairs the NEXT WARM_AHEAD items read, into L2 while this item computes
// from L1. Without it the core's memory traffic stops for the length of the item's
// arithmetic, and the next item then waits on DRAM for every block; with one item ahead
// the step's attention (its K/V scattered in 2 KiB page rows, far beyond the caches) ran
// ~10% slower than with two (docs/performance.md §16). Prefetches change no arithmetic:
// the bits are unchanged.
constexpr int WARM_AHEAD = 2;

template <typename KV>
struct Warm {
  const KV* k = nullptr;  // rows to warm: a coming item's K and V (nullptr: none)
  const KV* v = nullptr;
  const int32_t* pages = nullptr;
  int64_t last = -1;  // that item's own last key position
};

// The rows of the item `ahead` items after (token t, KV head kv_head), in item order.
template <typename KV>
Warm<KV> warm_for(const Problem<KV>& pr, int64_t t, int64_t kv_head, int64_t ahead) {
  Warm<KV> w;
  const int64_t next = t * pr.kv_heads + kv_head + ahead;
  const int64_t nt = next / pr.kv_heads, nh = next % pr.kv_heads;
  if (nt >= pr.tokens) return w;
  const int64_t base = (pr.layer * pr.kv_heads + nh) * pr.slots * pr.head_dim;
  w.k = pr.k + base;
  w.v = pr.v + base;
  w.pages = pr.table + std::clamp<int64_t>(pr.seq[nt], 0, pr.batch - 1) * pr.max_pages;
  w.last = std::clamp<int64_t>(pr.pos[nt], 0, pr.max_pages * pr.page_size - 1);
  return w;
}

// Prefetch into L2 (locality 2: not L1, which the item's own rows need) the warmed rows of
// keys [b0, b0 + KEY_BLOCK). Always inlined: GCC's pure-function analysis sees a call that
// only reads memory and returns nothing, and deletes it (prefetches included) if it stays a
// call.
template <int HD, bool TERMS, typename KV>
__attribute__((always_inline)) inline void warm_block(const Problem<KV>& pr,
                                                      const Warm<KV>& w, int64_t b0) {
  const int64_t end = std::min<int64_t>(b0 + KEY_BLOCK, w.last + 1);
  const BlockSlots slots(w.pages, pr.page_size, b0);
  // (a window item's own first key: first_key of its last; computed here, not held in
  // Warm, which an item keeps for every block: a larger Warm slowed the plain path by
  // 5-14%, scripts/ab_attention.py's cases)
  const int64_t start = TERMS ? std::max(b0, first_key(w.last, pr.window)) : b0;
  for (int64_t key = start; key < end; ++key) {
    const int64_t slot = slots(static_cast<int>(key - b0));
    if (slot < 0 || slot >= pr.slots) continue;
    for (const KV* pool : {w.k, w.v}) {
      const char* row = reinterpret_cast<const char*>(pool + slot * HD);
      for (int c = 0; c < HD * int{sizeof(KV)}; c += 64) __builtin_prefetch(row + c, 0, 2);
    }
  }
}

// One item: token t's G query heads that share KV head `kv_head` (heads kv_head*G ..
// kv_head*G + G-1), against its sequence's keys at positions <= p. Each K/V row is loaded
// (and, in bfloat16, widened) once for the G heads; each head's arithmetic is exactly the
// one-head computation (its own registers, the same operations in the same order), so a
// head's bits do not depend on G or on its neighbours. Everything lives in registers.
// TERMS: the call has a window, sinks or a soft cap; without (every plain call) the code is
// the plain causal attention alone, none of their per-block work compiled in.
template <int HD, int G, typename KV, bool TERMS>
void attend_group(const Problem<KV>& pr, int64_t t, int64_t kv_head, int64_t g0) {
  constexpr int V = HD / 16;
  const int64_t s = std::clamp<int64_t>(pr.seq[t], 0, pr.batch - 1);
  const int64_t p = std::clamp<int64_t>(pr.pos[t], 0, pr.max_pages * pr.page_size - 1);
  const int32_t* pages = pr.table + s * pr.max_pages;
  const int64_t base = (pr.layer * pr.kv_heads + kv_head) * pr.slots;
  const KV* kh = pr.k + base * HD;
  const KV* vh = pr.v + base * HD;
  const int64_t head0 = kv_head * pr.group + g0;
  using R = Row<KV, HD>;
  F16 q[G][V], acc[G][V];
  for (int g = 0; g < G; ++g) {
    R::permute(pr.q + (t * pr.heads + head0 + g) * HD, q[g]);
    for (int i = 0; i < V; ++i) {
      q[g][i] *= pr.scale;
      acc[g][i] = F16{};
    }
  }
  float m[G], l[G];  // running max and sum; a sink is the softmax's first term
  for (int g = 0; g < G; ++g) {
    m[g] = TERMS && pr.sinks != nullptr ? pr.sinks[head0 + g] : MASK;
    l[g] = TERMS && pr.sinks != nullptr ? 1.0f : 0.0f;
  }
  const int64_t lo = TERMS ? first_key(p, pr.window) : 0;
  const KV* vrow[KEY_BLOCK];
  Warm<KV> warm[WARM_AHEAD];
  if (g0 == 0)
    for (int a = 0; a < WARM_AHEAD; ++a) warm[a] = warm_for(pr, t, kv_head, a + 1);
  for (int64_t b0 = lo - lo % KEY_BLOCK; b0 <= p; b0 += KEY_BLOCK) {
    const int n = static_cast<int>(std::min<int64_t>(KEY_BLOCK, p + 1 - b0));
    const int skip = TERMS ? static_cast<int>(std::max<int64_t>(0, lo - b0)) : 0;  // before lo
    for (int a = 0; a < WARM_AHEAD; ++a)
      if (b0 <= warm[a].last && (!TERMS || b0 + KEY_BLOCK > first_key(warm[a].last,
                                                                      pr.window)))
        warm_block<HD, TERMS>(pr, warm[a], b0);
    const BlockSlots slots(pages, pr.page_size, b0);
    // Scores of the block's 16 keys: each key's 16-lane partial product summed by hsum's
    // tree for 16 keys at once (halves8, halves4, pairs02, adjacent) instead of one hsum
    // per key; keys past p count as 0 and are masked below. The loops nest by stage so that
    // each stage's pair is reduced as soon as it exists: at most one pending vector per
    // stage and head stays live, not 16 partial products per head.
    F16 sc[G];
    {
      F16 s3[G][2];
      for (int h8 = 0; h8 < 2; ++h8) {
        F16 s2[G][2];
        for (int h4 = 0; h4 < 2; ++h4) {
          F16 s1[G][2];
          for (int h2 = 0; h2 < 2; ++h2) {
            F16 d[G][2];
            for (int u = 0; u < 2; ++u) {
              const int j = h8 * 8 + h4 * 4 + h2 * 2 + u;
              if (j < n && j >= skip) {
                const int64_t slot = slots(j);
                const KV* kr = kh + slot * HD;
                vrow[j] = vh + slot * HD;
                F16 kv[V];
                R::load_row(kr, kv);
                for (int g = 0; g < G; ++g) {
                  F16 acc_d = q[g][0] * kv[0];
                  for (int i = 1; i < V; ++i) acc_d = fmadd(q[g][i], kv[i], acc_d);
                  d[g][u] = acc_d;
                }
              } else {
                for (int g = 0; g < G; ++g) d[g][u] = F16{};
              }
            }
            for (int g = 0; g < G; ++g) s1[g][h2] = halves8(d[g][0], d[g][1]);
          }
          for (int g = 0; g < G; ++g) s2[g][h4] = halves4(s1[g][0], s1[g][1]);
        }
        for (int g = 0; g < G; ++g) s3[g][h8] = pairs02(s2[g][0], s2[g][1]);
      }
      const I16 lane = iota();
      for (int g = 0; g < G; ++g) {
        F16 all = adjacent(s3[g][0], s3[g][1]);
        if constexpr (TERMS) {
          if (pr.softcap > 0.0f) all = tanh_lanes(all / pr.softcap) * pr.softcap;
          sc[g] = select(less(lane, splat_i(n)) & at_least(lane, splat_i(skip)), all,
                         splat(MASK));
        } else {
          sc[g] = select(less(lane, splat_i(n)), all, splat(MASK));
        }
      }
    }
    // the G heads' rescale factors exp(m_old - m_new) in one vector (lane g: head g;
    // exp_nonpositive is lane-wise, so a lane's bits do not depend on the others)
    float mx[G];
    float shift[16] = {};
    for (int g = 0; g < G; ++g) {
      const float mb = hmax(sc[g]);
      mx[g] = mb > m[g] ? mb : m[g];
      shift[g] = m[g] - mx[g];
    }
    const F16 alpha = exp_nonpositive(load(shift));
    float w[G][KEY_BLOCK];  // the block's weights, read back one key at a time
    for (int g = 0; g < G; ++g) {
      const F16 wg = exp_nonpositive(sc[g] - mx[g]);
      store(wg, w[g]);
      const float ag = lane(alpha, g);
      l[g] = fmadd(l[g], ag, hsum(wg));
      m[g] = mx[g];
      for (int i = 0; i < V; ++i) acc[g][i] *= ag;
    }
    for (int j = skip; j < n; ++j) {
      F16 vv[V];
      R::load_row(vrow[j], vv);
      for (int i = 0; i < V; ++i)
        for (int g = 0; g < G; ++g) acc[g][i] = fmadd(splat(w[g][j]), vv[i], acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    F16 o[V];
    for (int i = 0; i < V; ++i) o[i] = acc[g][i] * inv;
    R::store_row(o, pr.out + (t * pr.heads + head0 + g) * HD);
  }
}

// One work item: token t, KV head kv_head, all its query heads, in sub-groups of at most
// max_group(HD) heads, so that a sub-group's queries and accumulators stay in the register
// file (4 heads up to head_dim 64, 2 above; fewer instantiations also keep the build short).
constexpr int max_group(int hd) { return hd <= 64 ? 4 : 2; }

template <int HD, typename KV, bool TERMS>
void attend_item(const Problem<KV>& pr, int64_t t, int64_t kv_head) {
  constexpr int MAX_G = max_group(HD);
  for (int64_t g0 = 0; g0 < pr.group; g0 += MAX_G) {
    const int64_t g = std::min<int64_t>(MAX_G, pr.group - g0);
    if constexpr (MAX_G == 4) {
      if (g == 4) { attend_group<HD, 4, KV, TERMS>(pr, t, kv_head, g0); continue; }
      if (g == 3) { attend_group<HD, 3, KV, TERMS>(pr, t, kv_head, g0); continue; }
    }
    if (g == 2) attend_group<HD, 2, KV, TERMS>(pr, t, kv_head, g0);
    else attend_group<HD, 1, KV, TERMS>(pr, t, kv_head, g0);
  }
}

template <typename KV>
using ItemFn = void (*)(const Problem<KV>&, int64_t, int64_t);

template <int HD, typename KV>
ItemFn<KV> item_for(bool terms) {
  return terms ? attend_item<HD, KV, true> : attend_item<HD, KV, false>;
}

template <ffi::DataType POOL>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<POOL> k_pool, ffi::Buffer<POOL> v_pool,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> token_seq,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> window,
                              ffi::Buffer<ffi::F32> sinks, int64_t page_size, float scale,
                              int64_t has_sinks, float softcap,
                              ffi::ResultBuffer<ffi::F32> out) {
  using KV = std::remove_cv_t<std::remove_pointer_t<decltype(k_pool.typed_data())>>;
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const auto td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,HD], pools [L,KV,S,HD], "
                                       "page table [B,P] expected");
  Problem<KV> pr;
  pr.q = q.typed_data();
  pr.k = k_pool.typed_data();
  pr.v = v_pool.typed_data();
  pr.out = out->typed_data();
  pr.pos = positions.typed_data();
  pr.seq = token_seq.typed_data();
  pr.table = page_table.typed_data();
  pr.tokens = qd[0];
  pr.heads = qd[1];
  pr.head_dim = qd[2];
  pr.kv_heads = kd[1];
  pr.slots = kd[2];
  pr.batch = td[0];
  pr.max_pages = td[1];
  pr.layer = layer.typed_data()[0];
  pr.page_size = page_size;
  pr.scale = scale;
  pr.window = window.typed_data()[0];
  pr.sinks = has_sinks != 0 ? sinks.typed_data() : nullptr;
  pr.softcap = softcap;
  if (has_sinks != 0 && (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != qd[1]))
    return ffi::Error::InvalidArgument("paged_attention: sinks [H] expected");
  if (pr.kv_heads < 1 || pr.heads % pr.kv_heads != 0 || kd[3] != pr.head_dim)
    return ffi::Error::InvalidArgument("paged_attention: unsupported head layout");
  pr.group = pr.heads / pr.kv_heads;
  ItemFn<KV> item = nullptr;
  const bool terms = pr.window > 0 || pr.sinks != nullptr || pr.softcap > 0.0f;
  switch (pr.head_dim) {
    case 16: item = item_for<16, KV>(terms); break;
    case 32: item = item_for<32, KV>(terms); break;
    case 48: item = item_for<48, KV>(terms); break;
    case 64: item = item_for<64, KV>(terms); break;
    case 80: item = item_for<80, KV>(terms); break;
    case 96: item = item_for<96, KV>(terms); break;
    case 128: item = item_for<128, KV>(terms); break;
    case 256: item = item_for<256, KV>(terms); break;
    default: return ffi::Error::InvalidArgument("paged_attention: unsupported head_dim");
  }
  if (pr.layer < 0 || pr.layer >= kd[0])
    return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const int64_t items = pr.tokens * pr.kv_heads;  // one (token, KV head) each
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(1, items / (threads * 8));
  const int64_t helpers = std::min<int64_t>(threads, items / chunk) - 1;
  multiserve::parallel_for(pool, items, chunk, helpers, [pr, item](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) item(pr, i / pr.kv_heads, i % pr.kv_heads);
  });
  return ffi::Error::Success();
}

}  // namespace

// The XLA handlers (left out of the arithmetic probe, tests/model/paged_attention_probe.cc,
// which calls the items directly).
#if !defined(MULTISERVE_KERNEL_PROBE)
XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiservePagedAttention, PagedAttentionImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiservePagedAttentionBf16, PagedAttentionImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif  // MULTISERVE_KERNEL_PROBE
