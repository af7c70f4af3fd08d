// multiserve's CPU LoRA delta, an XLA FFI custom call (built and loaded by
// multiserve/model/kernels/native.py, called by multiserve/model/layers/lora.py).
//
// delta[t, :] = ((x[t] @ A[layer, s]) @ B[layer, s]) * scale[s] with s = slots[t], for
// x [T, K], the adapter stacks a [L, S, K, R] and b [L, S, R, N] (read in place: the layer
// is a scalar operand, as in row_gemm.cc), scale [S] and slots [T]; float32 out [T, N].
// x, a and b are all float32 or all bfloat16 (widened in registers); every sum is
// float32. A token of slot 0 (no adapter) gets a zero row and costs nothing; a token
// reads only its own slot's matrices (the per-token gathered product: a step with one
// adapter in use reads one adapter, whatever the slot count).
//
// The APPLIED form (MultiserveLoraApply, what the forward calls): the same deltas for
// several projections of the same x at once (a layer's q, k, v; or gate, up), each added
// to its projection's output y [T, N] (an operand aliased to the result): for a token with
// an adapter, y'[t, n] = round(float(y[t, n]) + d[t, n]) (d materialized in float32
// first, then one float32 add, rounded once to y's dtype, to nearest even); a token of
// slot 0 is not touched, so its y' is y's bits exactly. One call instead of a call and
// an XLA fusion per projection.
//
// Row invariance BY CONSTRUCTION: xa[j] = sum over k = 0, 1, .., K-1 in that order of
// x[t, k] * A[k, j], one fused multiply-add per step into a running sum from zero; then
// d[n] = sum over j = 0, .., R-1 in order of xa[j] * B[j, n] the same way; then one
// multiply by the scale. Tokens are sorted by slot and computed in register blocks of up
// to TB tokens of one slot (each matrix row loaded once for the block), blocks spread
// over threads, which only decides which core and which registers hold a token's sums,
// never their order. So a token's delta depends only on
// its x row, its slot's A, B and scale: not on T, on the other tokens or their adapters,
// nor on the thread count. (Built with -ffp-contract=fast: `acc += a * b` is one FMA, in
// the vector and the scalar loops alike, so the vector path (R a multiple of 16) and the
// scalar one give the same bits.)

#include <algorithm>
#include <cstdint>
#include <cstring>
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
constexpr int TB = 8;  // the most tokens of one slot per block

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
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

template <typename E>
struct Problem {
  const E* x;      // [T, K]
  const E* a;      // [S, K, R] of the chosen layer
  const E* b;      // [S, R, N] of the chosen layer
  const float* scale;  // [S]
  const int32_t* slots;  // [T]
  float* d;        // [T, N] float32 (the delta form), or nullptr (the applied form)
  void* y;         // the applied form: [T, N] of x's type, d added in place
  int64_t k, r, n;
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

// Columns [n0, n0 + 16) of token t: d = acc * scale, stored (delta form) or added to y.
template <typename E>
inline void store16(const Problem<E>& pr, int64_t t, int64_t n0, vf acc, float sc) {
  vf d = acc * sc;
  materialize(d);
  if (pr.d != nullptr) {
    std::memcpy(pr.d + t * pr.n + n0, &d, sizeof d);
    return;
  }
  E* y = static_cast<E*>(pr.y) + t * pr.n + n0;
  float lanes[LANES];
  std::memcpy(lanes, &d, sizeof d);
  for (int c = 0; c < LANES; ++c) {
    float sum = to_float(y[c]) + lanes[c];
    from_float(sum, y + c);
  }
}

template <typename E>
inline void store1(const Problem<E>& pr, int64_t t, int64_t n, float acc, float sc) {
  float d = acc * sc;
  materialize(d);
  if (pr.d != nullptr) {
    pr.d[t * pr.n + n] = d;
    return;
  }
  E* y = static_cast<E*>(pr.y) + t * pr.n + n;
  from_float(to_float(*y) + d, y);
}

// The shrink of one block: xa[i][:] = x[tok[i]] @ A[slot] for its NT tokens (all of one
// slot: each A row loaded once for all of them), RV vectors of 16 ranks each.
template <typename E, int RV, int NT>
void shrink_vec(const Problem<E>& pr, const int64_t* tok, float (*xa)[64]) {
  const E* ar = pr.a + pr.slots[tok[0]] * pr.k * pr.r;
  const E* xr[NT];
  for (int i = 0; i < NT; ++i) xr[i] = pr.x + tok[i] * pr.k;
  vf acc[NT][RV];
  for (int i = 0; i < NT; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = vf{};
  for (int64_t k = 0; k < pr.k; ++k) {
    vf av[RV];
    for (int v = 0; v < RV; ++v) av[v] = load(ar + k * pr.r + LANES * v);
    for (int i = 0; i < NT; ++i) {
      const vf xv = vf{} + widen(xr[i][k]);
      for (int v = 0; v < RV; ++v) acc[i][v] += xv * av[v];
    }
  }
  for (int i = 0; i < NT; ++i) std::memcpy(xa[i], acc[i], sizeof acc[i]);
}

// The same sums one element at a time (any R up to 64).
template <typename E>
void shrink_scalar(const Problem<E>& pr, const int64_t* tok, int count, float (*xa)[64]) {
  for (int i = 0; i < count; ++i) {
    const E* xr = pr.x + tok[i] * pr.k;
    const E* ar = pr.a + pr.slots[tok[i]] * pr.k * pr.r;
    for (int64_t j = 0; j < pr.r; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < pr.k; ++k) acc += widen(xr[k]) * widen(ar[k * pr.r + j]);
      xa[i][j] = acc;
    }
  }
}

// The expand of one block: d[tok[i], :] = (xa[i] @ B[slot]) * scale[slot] for its NT
// tokens of one slot, 32 columns at a time (each B row loaded once for all of them),
// then 16, then one.
template <typename E, int NT>
void expand(const Problem<E>& pr, const int64_t* tok, const float (*xa)[64]) {
  const int32_t s = pr.slots[tok[0]];
  const E* br = pr.b + s * pr.r * pr.n;
  const float sc = pr.scale[s];
  int64_t n0 = 0;
  for (; n0 + 2 * LANES <= pr.n; n0 += 2 * LANES) {
    vf acc[NT][2];
    for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = vf{};
    for (int64_t j = 0; j < pr.r; ++j) {
      const vf b0 = load(br + j * pr.n + n0), b1 = load(br + j * pr.n + n0 + LANES);
      for (int i = 0; i < NT; ++i) {
        const vf xv = vf{} + xa[i][j];
        acc[i][0] += xv * b0;
        acc[i][1] += xv * b1;
      }
    }
    for (int i = 0; i < NT; ++i) {
      store16(pr, tok[i], n0, acc[i][0], sc);
      store16(pr, tok[i], n0 + LANES, acc[i][1], sc);
    }
  }
  for (int i = 0; i < NT; ++i) {
    int64_t n = n0;
    for (; n + LANES <= pr.n; n += LANES) {
      vf acc = vf{};
      for (int64_t j = 0; j < pr.r; ++j) acc += (vf{} + xa[i][j]) * load(br + j * pr.n + n);
      store16(pr, tok[i], n, acc, sc);
    }
    for (; n < pr.n; ++n) {
      float acc = 0.0f;
      for (int64_t j = 0; j < pr.r; ++j) acc += xa[i][j] * widen(br[j * pr.n + n]);
      store1(pr, tok[i], n, acc, sc);
    }
  }
}

template <typename E, int NT>
void run_block_of(const Problem<E>& pr, const int64_t* tok) {
  float xa[NT][64];
  switch (pr.r % LANES == 0 ? pr.r / LANES : 0) {
    case 1: shrink_vec<E, 1, NT>(pr, tok, xa); break;
    case 2: shrink_vec<E, 2, NT>(pr, tok, xa); break;
    case 3: shrink_vec<E, 3, NT>(pr, tok, xa); break;
    case 4: shrink_vec<E, 4, NT>(pr, tok, xa); break;
    default: shrink_scalar<E>(pr, tok, NT, xa); break;
  }
  expand<E, NT>(pr, tok, xa);
}

// One block: `count` (1..TB) tokens of one slot, in register blocks of 8, 4, 2, 1.
template <typename E>
void run_block(const Problem<E>& pr, const int64_t* tok, int count) {
  while (count > 0) {
    const int nt = count >= 8 ? 8 : count >= 4 ? 4 : count >= 2 ? 2 : 1;
    switch (nt) {
      case 8: run_block_of<E, 8>(pr, tok); break;
      case 4: run_block_of<E, 4>(pr, tok); break;
      case 2: run_block_of<E, 2>(pr, tok); break;
      default: run_block_of<E, 1>(pr, tok); break;
    }
    tok += nt;
    count -= nt;
  }
}

// The tokens with an adapter, in order (error: a slot out of [0, slots)).
ffi::Error active_tokens(const int32_t* slots, int64_t t_dim, int64_t s_dim,
                         std::vector<int64_t>& active) {
  active.reserve(t_dim);
  for (int64_t t = 0; t < t_dim; ++t) {
    if (slots[t] < 0 || slots[t] >= s_dim)
      return ffi::Error::InvalidArgument("lora: slot out of range");
    if (slots[t] != 0) active.push_back(t);
  }
  // by slot (then position): a block's tokens share their adapter's matrices
  std::stable_sort(active.begin(), active.end(),
                   [slots](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  return ffi::Error::Success();
}

// One projection's deltas for the `active` tokens (delta form: d; applied form: y).
template <typename E>
void run(ffi::ThreadPool& pool, const void* x, const ffi::AnyBuffer& a,
         const ffi::AnyBuffer& b, const float* scale, const int32_t* slots, int64_t layer,
         float* d, void* y, const std::vector<int64_t>& active) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  const int64_t s_dim = ad[1], k = ad[2], r = ad[3], n = bd[3];
  const Problem<E> pr{static_cast<const E*>(x),
                      static_cast<const E*>(a.untyped_data()) + layer * s_dim * k * r,
                      static_cast<const E*>(b.untyped_data()) + layer * s_dim * r * n,
                      scale, slots, d, y, k, r, n};
  // blocks: runs of up to TB tokens of one slot, (start, size) in `active`
  std::vector<std::pair<int64_t, int>> blocks;
  const int64_t count = static_cast<int64_t>(active.size());
  for (int64_t i = 0; i < count;) {
    int size = 1;
    while (size < TB && i + size < count && slots[active[i + size]] == slots[active[i]])
      ++size;
    blocks.emplace_back(i, size);
    i += size;
  }
  const int64_t* tok = active.data();
  const auto* bl = blocks.data();
  // ~ multiply-adds / 64 per token, the unit of product_split.h's threshold
  const int64_t units = count * std::max<int64_t>(1, (k * r + r * n) / 64);
  for_each_item(pool, static_cast<int64_t>(blocks.size()), units, false,
                [&pr, tok, bl](int64_t lo, int64_t hi) {
                  for (int64_t i = lo; i < hi; ++i)
                    run_block(pr, tok + bl[i].first, bl[i].second);
                });
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
  std::vector<int64_t> active;
  if (auto err = active_tokens(slots.typed_data(), xd[0], s_dim, active); !err.success())
    return err;
  const int64_t n = dd[1];
  float* out = d->typed_data();
  for (int64_t t = 0; t < xd[0]; ++t)
    if (slots.typed_data()[t] == 0) std::memset(out + t * n, 0, n * sizeof(float));
  if (et == ffi::DataType::F32)
    run<float>(pool, x.untyped_data(), a, b, scale.typed_data(), slots.typed_data(), l, out,
               nullptr, active);
  else
    run<uint16_t>(pool, x.untyped_data(), a, b, scale.typed_data(), slots.typed_data(), l,
                  out, nullptr, active);
  return ffi::Error::Success();
}

// x, slots, scale, layer, then (y, a, b) per projection; results: each y with its
// deltas added (the y operands aliased to them).
ffi::Error LoraApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs rest, ffi::RemainingRets outs) {
  const auto xd = x.dimensions(), td = slots.dimensions();
  const int64_t s_dim = scale.dimensions()[0];
  const auto et = x.element_type();
  if (td.size() != 1 || td[0] != xd[0] || rest.size() % 3 != 0 ||
      rest.size() / 3 != outs.size() ||
      (et != ffi::DataType::F32 && et != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("lora_apply: x [T, K] (float32 or bfloat16), "
                                       "slots [T], scale [S], layer, then (y, a, b) per "
                                       "projection, one result each");
  const int64_t l = layer.typed_data()[0];
  std::vector<int64_t> active;
  if (auto err = active_tokens(slots.typed_data(), xd[0], s_dim, active); !err.success())
    return err;
  for (size_t m = 0; m < outs.size(); ++m) {
    auto y = rest.get<ffi::AnyBuffer>(3 * m);
    auto a = rest.get<ffi::AnyBuffer>(3 * m + 1);
    auto b = rest.get<ffi::AnyBuffer>(3 * m + 2);
    auto out = outs.get<ffi::AnyBuffer>(m);
    if (!y.has_value() || !a.has_value() || !b.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("lora_apply: buffers expected");
    const auto yd = y->dimensions();
    if (!shapes_fit(x, *a, *b, s_dim) || l < 0 || l >= a->dimensions()[0] ||
        yd.size() != 2 || yd[0] != xd[0] || yd[1] != b->dimensions()[3] ||
        y->element_type() != et || (*out)->element_type() != et ||
        (*out)->untyped_data() != y->untyped_data())
      return ffi::Error::InvalidArgument("lora_apply: projection shapes or types differ, "
                                         "or its y is not aliased to its result");
    if (et == ffi::DataType::F32)
      run<float>(pool, x.untyped_data(), *a, *b, scale.typed_data(), slots.typed_data(), l,
                 nullptr, (*out)->untyped_data(), active);
    else
      run<uint16_t>(pool, x.untyped_data(), *a, *b, scale.typed_data(), slots.typed_data(),
                    l, nullptr, (*out)->untyped_data(), active);
  }
  return ffi::Error::Success();
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
                                  .RemainingArgs()
                                  .RemainingRets());
