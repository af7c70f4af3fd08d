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
// Row invariance BY CONSTRUCTION: xa[j] = sum over k = 0, 1, .., K-1 in that order of
// x[t, k] * A[k, j], one fused multiply-add per step into a running sum from zero; then
// d[n] = sum over j = 0, .., R-1 in order of xa[j] * B[j, n] the same way; then one
// multiply by the scale. Tokens are computed in register blocks of up to TB (any slots
// mixed) and blocks spread over threads, which only decides which core and which
// registers hold a token's sums, never their order. So a token's delta depends only on
// its x row, its slot's A, B and scale: not on T, on the other tokens or their adapters,
// nor on the thread count. (Built with -ffp-contract=fast: `acc += a * b` is one FMA, in
// the vector and the scalar loops alike, so the vector path (R a multiple of 16) and the
// scalar one give the same bits.)

#include <algorithm>
#include <cstdint>
#include <cstring>
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
constexpr int TB = 8;  // tokens per register block of the shrink

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
  float* d;        // [T, N]
  int64_t k, r, n;
};

// xa[i][:] = x[tok[i]] @ A[slot of tok[i]] for the `count` tokens of one block (RV vectors
// of 16 ranks each; the block's missing tokens repeat its last one and are not stored).
template <typename E, int RV>
void shrink_vec(const Problem<E>& pr, const int64_t* tok, int count, float (*xa)[64]) {
  const E* xr[TB];
  const E* ar[TB];
  for (int i = 0; i < TB; ++i) {
    const int64_t t = tok[std::min(i, count - 1)];
    xr[i] = pr.x + t * pr.k;
    ar[i] = pr.a + pr.slots[t] * pr.k * pr.r;
  }
  vf acc[TB][RV];
  for (int i = 0; i < TB; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = vf{};
  for (int64_t k = 0; k < pr.k; ++k) {
    for (int i = 0; i < TB; ++i) {
      const vf xv = vf{} + widen(xr[i][k]);
      const E* row = ar[i] + k * pr.r;
      for (int v = 0; v < RV; ++v) acc[i][v] += xv * load(row + LANES * v);
    }
  }
  for (int i = 0; i < count; ++i) std::memcpy(xa[i], acc[i], sizeof acc[i]);
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

// d[t, :] = (xa @ B[slot]) * scale[slot]: 64 columns at a time (4 independent sums in
// flight), then 16, then one.
template <typename E>
void expand(const Problem<E>& pr, int64_t t, const float* xa) {
  const int32_t s = pr.slots[t];
  const E* br = pr.b + s * pr.r * pr.n;
  const float sc = pr.scale[s];
  float* d = pr.d + t * pr.n;
  int64_t n0 = 0;
  for (; n0 + 4 * LANES <= pr.n; n0 += 4 * LANES) {
    vf acc[4] = {vf{}, vf{}, vf{}, vf{}};
    for (int64_t j = 0; j < pr.r; ++j) {
      const vf xv = vf{} + xa[j];
      for (int c = 0; c < 4; ++c) acc[c] += xv * load(br + j * pr.n + n0 + LANES * c);
    }
    for (int c = 0; c < 4; ++c) {
      const vf out = acc[c] * sc;
      std::memcpy(d + n0 + LANES * c, &out, sizeof out);
    }
  }
  for (; n0 + LANES <= pr.n; n0 += LANES) {
    vf acc = vf{};
    for (int64_t j = 0; j < pr.r; ++j) acc += (vf{} + xa[j]) * load(br + j * pr.n + n0);
    const vf out = acc * sc;
    std::memcpy(d + n0, &out, sizeof out);
  }
  for (; n0 < pr.n; ++n0) {
    float acc = 0.0f;
    for (int64_t j = 0; j < pr.r; ++j) acc += xa[j] * widen(br[j * pr.n + n0]);
    d[n0] = acc * sc;
  }
}

template <typename E>
void run_block(const Problem<E>& pr, const int64_t* tok, int count) {
  float xa[TB][64];
  switch (pr.r % LANES == 0 ? pr.r / LANES : 0) {
    case 1: shrink_vec<E, 1>(pr, tok, count, xa); break;
    case 2: shrink_vec<E, 2>(pr, tok, count, xa); break;
    case 3: shrink_vec<E, 3>(pr, tok, count, xa); break;
    case 4: shrink_vec<E, 4>(pr, tok, count, xa); break;
    default: shrink_scalar<E>(pr, tok, count, xa); break;
  }
  for (int i = 0; i < count; ++i) expand(pr, tok[i], xa[i]);
}

template <typename E>
ffi::Error run(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
               const ffi::AnyBuffer& b, ffi::Buffer<ffi::F32>& scale,
               ffi::Buffer<ffi::S32>& slots, int64_t layer, float* d) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  const int64_t t_dim = xd[0], s_dim = ad[1], k = ad[2], r = ad[3], n = bd[3];
  const Problem<E> pr{static_cast<const E*>(x.untyped_data()),
                      static_cast<const E*>(a.untyped_data()) + layer * s_dim * k * r,
                      static_cast<const E*>(b.untyped_data()) + layer * s_dim * r * n,
                      scale.typed_data(), slots.typed_data(), d, k, r, n};
  std::vector<int64_t> active;  // the tokens with an adapter, in order
  active.reserve(t_dim);
  for (int64_t t = 0; t < t_dim; ++t) {
    const int32_t s = pr.slots[t];
    if (s < 0 || s >= s_dim) return ffi::Error::InvalidArgument("lora_delta: slot out of range");
    if (s == 0)
      std::memset(d + t * n, 0, n * sizeof(float));
    else
      active.push_back(t);
  }
  const int64_t count = static_cast<int64_t>(active.size());
  const int64_t blocks = (count + TB - 1) / TB;
  const int64_t* tok = active.data();
  // ~ multiply-adds / 64 per token, the unit of product_split.h's threshold
  const int64_t units = count * std::max<int64_t>(1, (k * r + r * n) / 64);
  for_each_item(pool, blocks, units, false, [&pr, tok, count](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      run_block(pr, tok + i * TB, static_cast<int>(std::min<int64_t>(TB, count - i * TB)));
  });
  return ffi::Error::Success();
}

ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer,
                         ffi::ResultBuffer<ffi::F32> d) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  const auto sd = scale.dimensions(), td = slots.dimensions(), dd = d->dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || sd.size() != 1 ||
      td.size() != 1 || dd.size() != 2 || ad[0] != bd[0] || ad[1] != bd[1] ||
      ad[1] != sd[0] || ad[2] != xd[1] || ad[3] != bd[2] || td[0] != xd[0] ||
      dd[0] != xd[0] || dd[1] != bd[3] || ad[3] > 64)
    return ffi::Error::InvalidArgument("lora_delta: x [T, K], a [L, S, K, R <= 64], "
                                       "b [L, S, R, N], scale [S], slots [T] expected");
  const auto et = x.element_type();
  if (a.element_type() != et || b.element_type() != et ||
      (et != ffi::DataType::F32 && et != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("lora_delta: x, a and b all float32 or all bfloat16");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= ad[0]) return ffi::Error::InvalidArgument("lora_delta: layer out of range");
  float* out = d->typed_data();
  if (et == ffi::DataType::F32) return run<float>(pool, x, a, b, scale, slots, l, out);
  return run<uint16_t>(pool, x, a, b, scale, slots, l, out);
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
