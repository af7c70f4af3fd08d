// kv_write: one layer's new K or V rows written into the paged pool IN PLACE (an XLA FFI
// custom call whose pool operand is aliased to its result).
//
// Why: XLA:CPU has no bfloat16 arithmetic, so its float normalization turns a bf16
// scatter into float32 (the whole pool converted, updated, converted back and copied, per
// layer and step). A write is a copy of bits, so this kernel does exactly that: row t of
// `rows` [T, KV, HD] goes to pool[layer, h, slots[t], :] for every KV head h. Padding
// tokens write into slot 0 (page 0, the garbage page) as the XLA scatter did; where two
// rows name one slot (only padding can), the later row wins, as XLA's scatter leaves it
// unspecified and nothing reads that page. Works for any 2- or 4-byte element type.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvWriteImpl(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto rd = rows.dimensions();
  if (pd.size() != 4 || rd.size() != 3 || slots.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("kv_write: pool [L,KV,S,HD], rows [T,KV,HD], slots [T]");
  const int64_t L = pd[0], KV = pd[1], S = pd[2], HD = pd[3], T = rd[0];
  if (rd[1] != KV || rd[2] != HD || slots.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("kv_write: rows and pool shapes disagree");
  if (pool.element_type() != rows.element_type() || out->element_type() != pool.element_type())
    return ffi::Error::InvalidArgument("kv_write: pool and rows must share one dtype");
  const size_t item = ffi::ByteWidth(pool.element_type());
  if (item != 2 && item != 4) return ffi::Error::InvalidArgument("kv_write: 2- or 4-byte types");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("kv_write: layer out of range");
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data())  // not aliased (XLA chose a copy): start from the pool
    std::memcpy(dst, pool.untyped_data(), static_cast<size_t>(L * KV * S * HD) * item);
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  const size_t row_bytes = static_cast<size_t>(HD) * item;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot[t];
    if (s < 0 || s >= S) return ffi::Error::InvalidArgument("kv_write: slot out of range");
    for (int64_t h = 0; h < KV; ++h)
      std::memcpy(dst + (((l * KV + h) * S + s) * HD) * item,
                  src + ((t * KV + h) * HD) * item, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MultiserveKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
