// The row-invariant product's register blocks (model/kernels/src/row_gemm.cc, included
// whole) on fixed operands, written to argv[1]: whether its multiply-adds are fused (a
// uint32), then the float32 bits of every block size 1..6, plain and warming, and of the
// public one-row panel. tests/model/test_kernel_arithmetic.py
// builds it for several -march targets (and with MULTISERVE_GENERIC_BLOCK, the generic
// block where the build has a specialised one) and compares the files.
#include <cstdio>
#include <vector>

#define MULTISERVE_KERNEL_PROBE
#include "row_gemm.cc"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const int64_t k = 203, panels = 2, rows = 6;
  std::vector<float> x(rows * k), wp(panels * k * PANEL), y(rows * panels * PANEL);
  uint32_t state = 12345;
  auto next = [&state]() {  // a fixed sequence of floats in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) / (1 << 23);
  };
  for (float& v : x) v = next();
  for (float& v : wp) v = next();
  std::FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 3;
  const uint32_t fused = multiserve::float_ops::FUSED ? 1 : 0;  // one rounding a step
  std::fwrite(&fused, sizeof fused, 1, out);
  for (int warmed = 0; warmed < 2; ++warmed)
    for (int64_t r = 1; r <= rows; ++r)
      for (int64_t p = 0; p < panels; ++p) {
        std::fill(y.begin(), y.end(), 0.0f);
        WarmRows warm;
        if (warmed) {
          warm.rows = wp.data() + (p + 1) * k * PANEL;
          warm.every = 2;
          warm.count = p + 1 < panels ? k / 2 : 0;
        }
        block_rows(r, x.data(), k, wp.data() + p * k * PANEL, y.data(), PANEL, 0, warm);
        std::fwrite(y.data(), sizeof(float), r * PANEL, out);
      }
  std::vector<float> one(panels * PANEL);
  for (int64_t p = 0; p < panels; ++p)
    multiserve::row_gemm_panel(x.data(), k, wp.data(), p, one.data(), nullptr);
  std::fwrite(one.data(), sizeof(float), one.size(), out);
  std::fclose(out);
  return 0;
}
