// The LoRA adapter stacks as lora_delta.cc takes them: the shape check of one
// projection's (a, b) against x, and the projection at one layer of the stacks, read in
// place. (row_gemm_lora.cc reads B from its panel copy and checks its own operands.)

#ifndef MULTISERVE_NATIVE_LORA_OPERANDS_H_
#define MULTISERVE_NATIVE_LORA_OPERANDS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace multiserve {

// One projection at one layer: its stacks' slots there, and where its columns lie in the
// output rows.
template <typename E>
struct LoraModule {
  const E* a;      // [S, K, R] of the chosen layer
  const E* b;      // [S, R, N] of the chosen layer
  int64_t n;       // its columns
  int64_t offset;  // its first column in the output rows
};

// a [L, S, K, R <= 64] and b [L, S, R, N] of one projection, of x [T, K]'s type, with
// s_dim slots (scale [S])
inline bool lora_shapes_fit(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& a,
                            const xla::ffi::AnyBuffer& b, int64_t s_dim) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  return xd.size() == 2 && ad.size() == 4 && bd.size() == 4 && ad[0] == bd[0] &&
         ad[1] == bd[1] && ad[1] == s_dim && ad[2] == xd[1] && ad[3] == bd[2] &&
         ad[3] <= 64 && a.element_type() == x.element_type() &&
         b.element_type() == x.element_type();
}

// The projection (a, b) at `layer` (in range: checked by the caller), its columns from
// `offset`.
template <typename E>
LoraModule<E> lora_module(const xla::ffi::AnyBuffer& a, const xla::ffi::AnyBuffer& b,
                          int64_t layer, int64_t offset) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  return LoraModule<E>{static_cast<const E*>(a.untyped_data()) + layer * ad[1] * ad[2] * ad[3],
                       static_cast<const E*>(b.untyped_data()) + layer * bd[1] * bd[2] * bd[3],
                       bd[3], offset};
}

}  // namespace multiserve

#endif  // MULTISERVE_NATIVE_LORA_OPERANDS_H_
