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
// The per-token arithmetic (shrink, expand sums, scale, add and rounding) is
// lora_math.h's, which row_gemm_lora.cc (the product with this applied delta in its
// epilogue, at one token) runs too: the two forms give a token the same bits.
//
// Row invariance BY CONSTRUCTION: xa[j] = sum over k = 0, 1, .., K-1 in that order of
// x[t, k] * A[k, j], one fused multiply-add per step into a running sum from zero (in
// bfloat16: pairs of k, in four chains of fixed extent combined in a fixed order, see
// shrink_bf16; the order is still a function of K alone); then
// d[n] = sum over j = 0, .., R-1 in order of xa[j] * B[j, n] the same way; then one
// multiply by the scale. Runs, blocks, tiles and threads only decide which core and which
// registers hold a token's sums, never their order. So a token's delta depends only on
// its x row, its slot's A, B and scale: not on T, on the other tokens or their adapters,
// nor on the thread count. (Every multiply-add is float_ops.h's explicit `fmadd`, in the
// vector and the scalar loops alike, so the vector path (R a multiple of 16) and the
// scalar one give the same bits in any build.)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora_math.h"
#include "lora_operands.h"
#include "product_split.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using multiserve::for_each_item;
using multiserve::lora_module;
using multiserve::lora_shapes_fit;

namespace {

using namespace multiserve::lora_math;

// One projection of a call: its adapter stacks' layer and where its columns lie in y / d.
template <typename E>
using Module = multiserve::LoraModule<E>;

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

// Columns [c, c + 16) of token t (c counted in the output row): d = acc * scale, stored
// (delta form) or added to y (one float32 add, rounded once to y's type).
template <typename E>
inline void store16(const Problem<E>& pr, int64_t t, int64_t c, vf acc, float sc) {
  const vf d = scaled(acc, sc);
  if (pr.d != nullptr)
    store(d, pr.d + t * pr.width + c);
  else
    add_to(pr.y + t * pr.width + c, d);
}

template <typename E>
inline void store1(const Problem<E>& pr, int64_t t, int64_t c, float acc, float sc) {
  const float d = scaled(acc, sc);
  if (pr.d != nullptr)
    pr.d[t * pr.width + c] = d;
  else
    add_to(pr.y + t * pr.width + c, d);
}

// The shrink of NT tokens of one slot (tok[first .. first + NT)) of module m
// (lora_math.h's `shrink`: each A row loaded once for all of them).
template <typename E, int NT>
void shrink_block(Problem<E>& pr, size_t m, int64_t first) {
  const int64_t* tok = pr.tok.data() + first;
  const E* ar = pr.modules[m].a + pr.slots[tok[0]] * pr.k * pr.r;
  const E* xr[NT];
  float* out[NT];
  for (int i = 0; i < NT; ++i) {
    xr[i] = pr.x + tok[i] * pr.k;
    out[i] = pr.xa_of(first + i, m);
  }
  shrink<E, NT>(xr, ar, pr.k, pr.r, out);
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
  expand_sums<S, NT, CV>(xa, br, rows.stride, pr.r, acc);
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
      store1(pr, pr.tok[i], mod.offset + c, expand_sum(xa, rows.at(0, c), rows.stride, pr.r),
             pr.scale[s]);
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

template <typename E>
ffi::Error delta(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                 const ffi::AnyBuffer& b, const float* scale, const int32_t* slots,
                 int64_t layer, float* out) {
  const auto xd = x.dimensions();
  const int64_t s_dim = a.dimensions()[1], n = b.dimensions()[3];
  Problem<E> pr{static_cast<const E*>(x.untyped_data()), scale, slots, out, nullptr,
                xd[1], a.dimensions()[3], n, {lora_module<E>(a, b, layer, 0)}, {}, {}, {}};
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
  if (!lora_shapes_fit(x, a, b, s_dim) || td.size() != 1 || td[0] != xd[0] ||
      dd.size() != 2 || dd[0] != xd[0] || dd[1] != b.dimensions()[3] ||
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
    if (!lora_shapes_fit(x, *a, *b, s_dim) || layer < 0 || layer >= a->dimensions()[0] ||
        offsets[m] < 0 || offsets[m] + b->dimensions()[3] > width ||
        (m > 0 && a->dimensions()[3] != pr.r))
      return ffi::Error::InvalidArgument("lora_apply: projection shapes or types differ, "
                                         "or its columns fall outside y");
    pr.r = a->dimensions()[3];
    pr.modules.push_back(lora_module<E>(*a, *b, layer, offsets[m]));
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
