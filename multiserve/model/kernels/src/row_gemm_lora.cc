// multiserve's CPU product with the LoRA delta in its epilogue, at ONE row: an XLA FFI
// custom call (built and loaded by multiserve/model/kernels/native.py, called by
// multiserve/model/layers/lora.py at one-token steps).
//
// y [1, P * 64] = the dense product of row_gemm.cc (float32 panels) or row_gemm_bf16.cc
// (bfloat16 k-pair panels) of x [1, K] with the layer `layer` of the panels, the residual
// added where given (the o and down products), THEN, where the row's slot is not 0, the
// applied LoRA delta of every member m (a fused product's projections, or the one
// projection) added to its columns [offsets[m], offsets[m] + N_m): what
// lora_apply_native (lora_delta.cc) adds to that product's output, with the same
// per-element operations (model/kernels/src/lora_math.h: the same code), so y's bits are
// those of the product call followed by the lora_apply call, whatever the thread count.
// A slot-0 row, and every column no member covers, keeps the product's bits.
//
// B is read from its panel copy (the runner's `<m>_bp` [L, S, P, R, 64], written beside
// `<m>_b` [L, S, R, N] when an adapter is loaded: model/lora_layout.py `b_panels`): the
// R x 64 values of B that one product panel's columns need lie in one contiguous block,
// the same values as B's rows at those columns, summed in the same order, so the bits
// are those of B read by rows. Members start at panel boundaries (the fused products'
// layout), so a panel's columns belong to one member at most.
//
// Work: the panels in one contiguous run per thread (product_split.h), each panel
// computed by row_panel.h's entry point, then its member's delta over the panel's
// columns, so the adapter's B streams on every core together with W's panels (each
// panel's B block, 2 KB in bfloat16 at rank 16, prefetched before its product block:
// prefetcht0, which on this machine's Zen 5 brought the lines in time where prefetcht1
// did not, and which measured faster than spreading them through the k loop,
// docs/performance.md §24). A run computes xa = x @ A of a member when its first panel
// needs it (A prefetched through that panel's product k loop, summed after it): a member
// whose columns span both runs is summed by both, the same bits, with no thread waiting
// on another.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "lora_math.h"
#include "product_split.h"
#include "row_panel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using multiserve::for_each_item;
using multiserve::work_units;

namespace {

constexpr int64_t PANEL = 64;       // columns per product panel
constexpr int64_t MAX_MEMBERS = 8;  // projections in one call

// One LoRA member at the row's slot: A [K, R], B's panels [ceil(N / 64), R, 64], its N
// columns in y from `offset` (a multiple of 64).
template <typename E>
struct Member {
  const E* a;
  const E* bp;
  int64_t n, offset;
};

template <typename E>
struct Call {
  const E* x;       // [K]
  E* y;             // [P * 64]
  const E* res;     // [P * 64] or nullptr
  const void* panels;  // the chosen layer's panels (float32 or bfloat16 k-pair)
  bool bf16_panels;
  int64_t k, r, panels_count, path;
  float scale;      // of the row's slot
  int64_t members;  // 0 for a slot-0 row: the product alone
  Member<E> member[MAX_MEMBERS];
};

// Columns [c0, c1) of member m that fall in panel p (c0 >= c1: none).
template <typename E>
inline void columns_in(const Member<E>& mem, int64_t p, int64_t& c0, int64_t& c1) {
  c0 = std::max(mem.offset, p * PANEL);
  c1 = std::min(mem.offset + mem.n, (p + 1) * PANEL);
}

template <typename E>
void product_panel(const Call<E>& call, int64_t p, multiserve::Warm warm) {
  if constexpr (std::is_same_v<E, float>) {
    if (!call.bf16_panels) {
      multiserve::row_gemm_panel(call.x, call.k, static_cast<const float*>(call.panels), p,
                                 call.y, call.res, warm);
      return;
    }
  }
  const bool e_bf16 = std::is_same_v<E, uint16_t>;
  const multiserve::Bf16Row row{call.x, e_bf16, static_cast<const uint16_t*>(call.panels),
                                call.k, call.panels_count, call.y, e_bf16,
                                reinterpret_cast<const uint16_t*>(call.res), call.path};
  multiserve::row_gemm_bf16_panel(row, p, warm);
}

template <typename E>
void compute_xa(const Call<E>& call, int64_t m, float* xa) {
  const E* xr[1] = {call.x};
  float* out[1] = {xa};
  multiserve::lora_math::shrink<E, 1>(xr, call.member[m].a, call.k, call.r, out);
}

// Member m's block of B for its columns in panel p: [R, 64], row j = B[j, those columns]
template <typename E>
inline const E* b_block(const Call<E>& call, const Member<E>& mem, int64_t p) {
  return mem.bp + (p - mem.offset / PANEL) * call.r * PANEL;
}

// Member m's delta over its columns in panel p, added to y.
template <typename E>
void add_delta(const Call<E>& call, int64_t m, int64_t p, const float* xa) {
  const Member<E>& mem = call.member[m];
  int64_t c0, c1;
  columns_in(mem, p, c0, c1);
  multiserve::lora_math::apply_columns(xa, b_block(call, mem, p), PANEL, call.r, c1 - c0,
                                       call.scale, call.y + c0);
}

// xa of each member for one thread's run of panels: computed by the run when a panel
// first needs it (A prefetched during that panel's product k loop, summed after it).
struct RunXa {
  alignas(64) float xa[MAX_MEMBERS][64];
  bool have[MAX_MEMBERS] = {};
};

// One work item: panel p's product, then the delta of the member it covers (if any).
template <typename E>
void run_panel(const Call<E>& call, RunXa& run, int64_t p) {
  int64_t covered = -1;
  for (int64_t m = 0; m < call.members && covered < 0; ++m) {
    int64_t c0, c1;
    columns_in(call.member[m], p, c0, c1);
    if (c0 < c1) covered = m;
  }
  multiserve::Warm warm;
  if (covered >= 0) {
    const Member<E>& mem = call.member[covered];
    const E* block = b_block(call, mem, p);
    const int64_t block_bytes = call.r * PANEL * static_cast<int64_t>(sizeof(E));
    for (int64_t off = 0; off < block_bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(block) + off, 0, 3);
    if (!run.have[covered])
      warm = multiserve::Warm{mem.a, call.k * call.r * static_cast<int64_t>(sizeof(E))};
  }
  product_panel(call, p, warm);
  if (covered < 0) return;
  if (!run.have[covered]) {
    compute_xa(call, covered, run.xa[covered]);
    run.have[covered] = true;
  }
  add_delta(call, covered, p, run.xa[covered]);
}

// The dense product with the slot's deltas: the panels in one contiguous run per thread
// (product_split.h), each run with the xa its panels need.
template <typename E>
void run(ffi::ThreadPool& pool, const Call<E>& call) {
  int64_t lora_bytes = 0;  // A and B of the slot, in units of 64 bytes below
  for (int64_t m = 0; m < call.members; ++m)
    lora_bytes += (call.k + call.member[m].n) * call.r * static_cast<int64_t>(sizeof(E));
  const int64_t k_rows = call.bf16_panels ? (call.k + 1) / 2 : call.k;
  const int64_t units = work_units(call.panels_count, 1, k_rows) + lora_bytes / 64;
  const Call<E>* c = &call;
  for_each_item(pool, call.panels_count, units, true, [c](int64_t b, int64_t e) {
    RunXa run;
    for (int64_t p = b; p < e; ++p) run_panel(*c, run, p);
    if constexpr (std::is_same_v<E, uint16_t>) multiserve::row_gemm_bf16_release();
  });
}

template <typename E>
ffi::Error fused(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& panels,
                 int64_t layer, int32_t slot, const float* scale, int64_t s_dim, int64_t path,
                 bool residual, const ffi::RemainingArgs& rest,
                 ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> widths,
                 void* y) {
  const auto xd = x.dimensions(), wd = panels.dimensions();
  const bool bf16_panels = panels.element_type() == ffi::DataType::BF16;
  const int64_t k = xd[1], count = wd[1];
  const int64_t panel_elems = wd[2] * wd[3];
  Call<E> call;
  call.x = static_cast<const E*>(x.untyped_data());
  call.y = static_cast<E*>(y);
  call.res = nullptr;
  const int64_t panel_bytes = panel_elems * (bf16_panels ? 2 : 4);  // bfloat16 or float32
  call.panels = static_cast<const char*>(panels.untyped_data()) + layer * count * panel_bytes;
  call.bf16_panels = bf16_panels;
  call.k = k;
  call.panels_count = count;
  call.path = path;
  call.scale = scale[slot];
  call.members = 0;
  call.r = 0;
  const size_t first_pair = residual ? 1 : 0;
  if (residual) {
    auto res = rest.get<ffi::AnyBuffer>(0);
    if (!res.has_value() || res->element_type() != x.element_type() ||
        res->dimensions().size() != 2 || res->dimensions()[0] != 1 ||
        res->dimensions()[1] != count * PANEL)
      return ffi::Error::InvalidArgument("row_gemm_lora: residual [1, P * 64] of x's type "
                                         "expected");
    call.res = static_cast<const E*>(res->untyped_data());
  }
  for (size_t m = 0; m < offsets.size(); ++m) {
    auto a = rest.get<ffi::AnyBuffer>(first_pair + 2 * m);
    auto bp = rest.get<ffi::AnyBuffer>(first_pair + 2 * m + 1);
    if (!a.has_value() || !bp.has_value())
      return ffi::Error::InvalidArgument("row_gemm_lora: (a, b panels) buffers expected");
    const auto ad = a->dimensions(), bd = bp->dimensions();
    const int64_t n = widths[m];
    if (ad.size() != 4 || bd.size() != 5 || ad[1] != s_dim || ad[2] != k || ad[3] > 64 ||
        bd[0] != ad[0] || bd[1] != s_dim || bd[2] != (n + PANEL - 1) / PANEL ||
        bd[3] != ad[3] || bd[4] != PANEL || a->element_type() != x.element_type() ||
        bp->element_type() != x.element_type() || layer >= ad[0] || n < 1 ||
        offsets[m] % PANEL != 0 || offsets[m] < (m > 0 ? offsets[m - 1] + widths[m - 1] : 0) ||
        offsets[m] + n > count * PANEL || (m > 0 && ad[3] != call.r))
      return ffi::Error::InvalidArgument(
          "row_gemm_lora: a [L, S, K, R <= 64] and b panels [L, S, ceil(N / 64), R, 64] of "
          "x's type, one R, members from panel boundaries in order, columns inside y");
    call.r = ad[3];
    if (slot == 0) continue;  // the product alone
    const int64_t a_slot = ad[2] * ad[3], b_slot = bd[2] * bd[3] * bd[4];
    call.member[call.members++] = Member<E>{
        static_cast<const E*>(a->untyped_data()) + (layer * s_dim + slot) * a_slot,
        static_cast<const E*>(bp->untyped_data()) + (layer * s_dim + slot) * b_slot, n,
        offsets[m]};
  }
  run(pool, call);
  return ffi::Error::Success();
}

// x [1, K], panels, layer, slots [1], scale [S], then (residual only) res [1, P * 64],
// then (a, b panels) per member; the result y [1, P * 64] of x's type. Attributes: offsets
// (a member's first column in y: multiples of 64, in order), widths (a member's N), path
// (bfloat16 panels: 0 kDot, 1 kWiden), residual (0, 1).
ffi::Error RowGemmLoraImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer panels,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::F32> scale, ffi::RemainingArgs rest,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> offsets,
                           ffi::Span<const int64_t> widths, int64_t path, int64_t residual) {
  const auto xd = x.dimensions(), wd = panels.dimensions(), yd = y->dimensions();
  const auto et = x.element_type(), pt = panels.element_type();
  const bool f32 = et == ffi::DataType::F32 && pt == ffi::DataType::F32;
  const bool bf16 = et == ffi::DataType::BF16 && pt == ffi::DataType::BF16;
  const int64_t members = static_cast<int64_t>(offsets.size());
  if (xd.size() != 2 || xd[0] != 1 || wd.size() != 4 || (!f32 && !bf16) ||
      wd[3] != (f32 ? PANEL : 2 * PANEL) || wd[2] != (f32 ? xd[1] : (xd[1] + 1) / 2) ||
      yd.size() != 2 || yd[0] != 1 || yd[1] != wd[1] * PANEL ||
      y->element_type() != et || slots.dimensions().size() != 1 ||
      slots.dimensions()[0] != 1 || members == 0 || members > MAX_MEMBERS ||
      static_cast<int64_t>(widths.size()) != members ||
      static_cast<int64_t>(rest.size()) != 2 * members + (residual ? 1 : 0))
    return ffi::Error::InvalidArgument("row_gemm_lora: x [1, K] and panels (both float32 "
                                       "or both bfloat16), y [1, P * 64], one slot, 1 to 8 "
                                       "members expected");
  if (bf16 && path != 0 && path != 1 && path != 2)
    return ffi::Error::InvalidArgument("row_gemm_lora: path 0 (dot), 1 (widen) or 2 (amx) "
                                       "expected");
  if (bf16 && path == 0 && !multiserve::row_gemm_bf16_dot_available())
    return ffi::Error::InvalidArgument("row_gemm_lora: the dot path needs AVX512_BF16");
  if (bf16 && path == 2 && !multiserve::row_gemm_bf16_amx_available())
    return ffi::Error::InvalidArgument("row_gemm_lora: the amx path needs AMX-BF16 tiles");
  const int64_t l = layer.typed_data()[0];
  const int32_t s = slots.typed_data()[0];
  const int64_t s_dim = scale.dimensions()[0];
  if (l < 0 || l >= wd[0] || s < 0 || s >= s_dim)
    return ffi::Error::InvalidArgument("row_gemm_lora: layer or slot out of range");
  if (f32)
    return fused<float>(pool, x, panels, l, s, scale.typed_data(), s_dim, path,
                        residual != 0, rest, offsets, widths, y->untyped_data());
  return fused<uint16_t>(pool, x, panels, l, s, scale.typed_data(), s_dim, path,
                         residual != 0, rest, offsets, widths, y->untyped_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveRowGemmLora, RowGemmLoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("widths")
                                  .Attr<int64_t>("path")
                                  .Attr<int64_t>("residual"));
