// The bfloat16 product's kWiden register blocks (model/kernels/src/row_gemm_bf16.cc,
// included whole) on fixed operands, written to argv[1]: whether its multiply-adds are
// fused (a uint32), then the bits of every block size 1..6, plain and warming, for float32
// and bfloat16 x, into float32 y, bfloat16 y and bfloat16 y with a residual, at an odd K
// (its last k alone). tests/model/test_kernel_arithmetic.py builds it as row_gemm_probe.cc.
#include <cstdio>
#include <vector>

#define MULTISERVE_KERNEL_PROBE
#include "row_gemm_bf16.cc"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const int64_t k = 203, k2 = (k + 1) / 2, panels = 2, rows = 6;
  uint32_t state = 54321;
  auto next = [&state]() {  // a fixed sequence of floats in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) / (1 << 23);
  };
  auto bf16 = [](float f) {  // truncated: any bfloat16 operand will do
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  };
  std::vector<float> xf(rows * k);
  std::vector<uint16_t> xb(rows * k), wp(panels * k2 * PAIR_ROW, 0), res(rows * panels * PANEL);
  // float32 x of full precision: its products with bfloat16 weights round (a bfloat16 x's
  // are exact, so there a fused and an unfused step agree)
  for (float& v : xf) v = next();
  for (uint16_t& v : xb) v = bf16(next());
  for (int64_t p = 0; p < panels; ++p)  // pair lanes; an odd K's last high half stays zero
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t c = 0; c < PANEL; ++c)
        wp[(p * k2 + kk / 2) * PAIR_ROW + 2 * c + kk % 2] = bf16(next());
  for (uint16_t& v : res) v = bf16(next());
  std::FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 3;
  const uint32_t fused = multiserve::float_ops::FUSED ? 1 : 0;
  std::fwrite(&fused, sizeof fused, 1, out);
  std::vector<float> yf(rows * panels * PANEL);
  std::vector<uint16_t> yb(rows * panels * PANEL);
  for (int form = 0; form < 3; ++form)  // y float32, y bfloat16, y bfloat16 + residual
    for (int x_bf16 = 0; x_bf16 < 2; ++x_bf16)
      for (int warmed = 0; warmed < 2; ++warmed)
        for (int r = 1; r <= rows; ++r)
          for (int64_t p = 0; p < panels; ++p) {
            std::fill(yf.begin(), yf.end(), 0.0f);
            std::fill(yb.begin(), yb.end(), 0);
            Out o{form == 0 ? static_cast<void*>(yf.data()) : static_cast<void*>(yb.data()),
                  form != 0, panels * PANEL, form == 2 ? res.data() : nullptr};
            WarmRows warm;
            if (warmed && p + 1 < panels) {
              warm.rows = wp.data() + (p + 1) * k2 * PAIR_ROW;
              warm.every = 2;
              warm.count = k2 / 2;
            }
            const uint16_t* panel = wp.data() + p * k2 * PAIR_ROW;
#define PROBE_BLOCK(R, W)                                                              \
  if (x_bf16)                                                                          \
    block_widen<R, W>(xb.data(), k, panel, o, p * PANEL, 0, warm);                     \
  else                                                                                 \
    block_widen<R, W>(xf.data(), k, panel, o, p * PANEL, 0, warm);
#define PROBE_ROWS(R) \
  case R:             \
    if (warmed) {     \
      PROBE_BLOCK(R, true)                                                             \
    } else {          \
      PROBE_BLOCK(R, false)                                                            \
    }                 \
    break;
            switch (r) { PROBE_ROWS(1) PROBE_ROWS(2) PROBE_ROWS(3) PROBE_ROWS(4)
                         PROBE_ROWS(5) PROBE_ROWS(6) }
            if (form == 0) std::fwrite(yf.data(), sizeof(float), yf.size(), out);
            else std::fwrite(yb.data(), sizeof(uint16_t), yb.size(), out);
          }
  std::fclose(out);
  return 0;
}
