// The paged attention kernel's items (model/kernels/src/paged_attention.cc, included whole)
// on fixed operands, written to argv[1]: whether its multiply-adds are fused (a uint32),
// then the float32 bits of every output, for float32 and bfloat16 pools, head_dim 64, 80
// (a trailing 16 dims) and 128, groups of 1 to 6 query heads a KV head, pages of 16 and 5
// slots, plain and with a sliding window, sinks and a soft cap. tests/model/
// test_kernel_arithmetic.py builds it in two paths (lanes16.h's pieces and one 16-lane
// vector) and compares the files.
#include <cstdio>
#include <vector>

#define MULTISERVE_KERNEL_PROBE
#include "paged_attention.cc"

namespace {

uint32_t state = 12345;
float next() {  // a fixed sequence of floats in [-1, 1)
  state = state * 1664525u + 1013904223u;
  return static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) / (1 << 23);
}

uint16_t to_bf16(float x) {  // truncation: any fixed bfloat16 values will do
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return static_cast<uint16_t>(b >> 16);
}

template <int HD, typename KV>
void run(std::FILE* out, int64_t heads, int64_t kv_heads, int64_t page_size, bool terms) {
  const int64_t tokens = 5, batch = 3, max_pages = 8, layers = 2;
  const int64_t slots = batch * max_pages * page_size;
  std::vector<float> q(tokens * heads * HD), o(tokens * heads * HD), sinks(heads);
  std::vector<KV> k(layers * kv_heads * slots * HD), v(k.size());
  for (float& x : q) x = 3.0f * next();
  for (size_t i = 0; i < k.size(); ++i) {
    const float a = next(), b = next();
    if constexpr (std::is_same_v<KV, float>) {
      k[i] = a;
      v[i] = b;
    } else {
      k[i] = to_bf16(a);
      v[i] = to_bf16(b);
    }
  }
  for (float& x : sinks) x = next();
  std::vector<int32_t> table(batch * max_pages), pos{0, 17, 40, 63, 90}, seq{0, 1, 1, 2, 0};
  for (int64_t i = 0; i < batch * max_pages; ++i)  // pages in a scrambled order
    table[i] = static_cast<int32_t>((i * 7 + 3) % (batch * max_pages));
  for (int32_t& p : pos) p = std::min<int32_t>(p, max_pages * page_size - 1);
  Problem<KV> pr;
  pr.q = q.data();
  pr.k = k.data();
  pr.v = v.data();
  pr.out = o.data();
  pr.pos = pos.data();
  pr.seq = seq.data();
  pr.table = table.data();
  pr.tokens = tokens;
  pr.heads = heads;
  pr.kv_heads = kv_heads;
  pr.group = heads / kv_heads;
  pr.head_dim = HD;
  pr.slots = slots;
  pr.batch = batch;
  pr.max_pages = max_pages;
  pr.layer = 1;
  pr.page_size = page_size;
  pr.scale = 0.125f;
  pr.window = terms ? 23 : 0;
  pr.sinks = terms ? sinks.data() : nullptr;
  pr.softcap = terms ? 2.5f : 0.0f;
  const ItemFn<KV> item = item_for<HD, KV>(terms);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) item(pr, t, h);
  std::fwrite(o.data(), sizeof(float), o.size(), out);
}

template <typename KV>
void every_case(std::FILE* out) {
  for (const bool terms : {false, true})
    for (const int64_t page : {16, 5}) {
      run<64, KV>(out, 9, 3, page, terms);
      run<64, KV>(out, 4, 1, page, terms);
      run<80, KV>(out, 6, 1, page, terms);
      run<128, KV>(out, 2, 2, page, terms);
      run<128, KV>(out, 5, 1, page, terms);
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 3;
  const uint32_t fused = multiserve::float_ops::FUSED ? 1 : 0;  // one rounding a step
  std::fwrite(&fused, sizeof fused, 1, out);
  every_case<float>(out);
  every_case<uint16_t>(out);
  return std::fclose(out) == 0 ? 0 : 4;
}
