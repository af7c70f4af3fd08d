// A probe of the LoRA kernels' per-element arithmetic (multiserve/model/kernels/src/
// lora_math.h, the code lora_delta.cc and row_gemm_lora.cc both inline), built by
// tests/model/test_kernel_arithmetic.py for several -march targets.
//
// It computes, on inputs fixed by a seed, every form the kernels use for the same sums:
// the shrink of one token and of register blocks of 2, 4 and 8 tokens (float32 vector and
// scalar ranks, bfloat16 pair chains), the expand by 16-column vectors in blocks of several
// tokens and by single columns, from B itself and from a float32 stage of it, and the
// applied delta (vectors of 64, 16, then single columns). The kernels promise these forms
// the same bits; the probe exits 1 and names the first pair that differs. It writes the
// bits of the one-token forms to the file named by its argument (after one word: 1 where
// the build fuses multiply-adds, float_ops.h's FUSED), so that builds for different -march
// targets can be compared.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "lora_math.h"

using namespace multiserve::lora_math;

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;

float uniform() {  // in [-1, 1), 24 random bits: never subnormal, never zero-exponent
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<float>(static_cast<int32_t>(state >> 40) - (1 << 23)) / (1 << 23);
}

uint16_t to_bf16(float v) {
  uint16_t h;
  from_float(v, &h);
  return h;
}

template <typename E>
E element(float v) {
  if constexpr (std::is_same_v<E, float>)
    return v;
  else
    return to_bf16(v);
}

int failures = 0;
std::vector<uint32_t> emitted;

void emit(const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, v + i, sizeof u);
    emitted.push_back(u);
  }
}

template <typename E>
void emit_elements(const E* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = to_float(v[i]);
    emit(&f, 1);
  }
}

void same(const char* what, const float* a, const float* b, int64_t n) {
  if (std::memcmp(a, b, n * sizeof(float)) == 0) return;
  for (int64_t i = 0; i < n && failures < 20; ++i)  // the first 20 pairs that differ
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      std::fprintf(stderr, "%s: element %lld differs: %.9g vs %.9g\n", what,
                   static_cast<long long>(i), a[i], b[i]);
      break;
    }
  ++failures;
}

constexpr int T = 8;     // tokens
constexpr int64_t N = 200;  // B's columns: 3 x 64, then 8 single columns

template <typename E, int NT>
void shrink_blocks(const std::vector<E>& x, const std::vector<E>& a, int64_t k, int64_t r,
                   std::vector<float>& out) {
  for (int t0 = 0; t0 < T; t0 += NT) {
    const E* xr[NT];
    float* o[NT];
    for (int i = 0; i < NT; ++i) {
      xr[i] = x.data() + (t0 + i) * k;
      o[i] = out.data() + (t0 + i) * 64;
    }
    shrink<E, NT>(xr, a.data(), k, r, o);
  }
}

// expand_sums over the columns [0, cols) in blocks of NT tokens and CV vectors, S the
// type B is read as (E itself, or the float32 stage)
template <typename S, int NT, int CV>
void expand_blocks(const std::vector<float>& xa, const S* b, int64_t r, int64_t cols,
                   std::vector<float>& out) {
  for (int t0 = 0; t0 < T; t0 += NT) {
    const float* xs[NT];
    for (int i = 0; i < NT; ++i) xs[i] = xa.data() + (t0 + i) * 64;
    for (int64_t c = 0; c + CV * LANES <= cols; c += CV * LANES) {
      vf acc[NT][CV];
      expand_sums<S, NT, CV>(xs, b + c, N, r, acc);
      for (int i = 0; i < NT; ++i)
        for (int v = 0; v < CV; ++v)
          store(acc[i][v], out.data() + (t0 + i) * N + c + LANES * v);
    }
  }
}

template <typename E>
void probe(int64_t k, int64_t r) {
  std::vector<E> x(T * k), a(k * r), b(r * N);
  for (auto& v : x) v = element<E>(uniform());
  for (auto& v : a) v = element<E>(uniform() * 0.125f);
  for (auto& v : b) v = element<E>(uniform());
  char what[96];
  const char* type = std::is_same_v<E, float> ? "float32" : "bfloat16";

  // the shrink: one token at a time, and in blocks of 2, 4, 8
  std::vector<float> xa(T * 64, 0.0f), other(T * 64, 0.0f);
  shrink_blocks<E, 1>(x, a, k, r, xa);
  for (int t = 0; t < T; ++t) emit(xa.data() + t * 64, r);
  const auto blocks = [&](auto nt, const char* name) {
    std::fill(other.begin(), other.end(), 0.0f);
    shrink_blocks<E, decltype(nt)::value>(x, a, k, r, other);
    for (int t = 0; t < T; ++t) {
      std::snprintf(what, sizeof what, "%s shrink K %lld R %lld, %s, token %d", type,
                    static_cast<long long>(k), static_cast<long long>(r), name, t);
      same(what, other.data() + t * 64, xa.data() + t * 64, r);
    }
  };
  blocks(std::integral_constant<int, 2>{}, "blocks of 2");
  blocks(std::integral_constant<int, 4>{}, "blocks of 4");
  blocks(std::integral_constant<int, 8>{}, "blocks of 8");
  if constexpr (std::is_same_v<E, float>) {  // the scalar form of a vector rank
    for (int t = 0; t < T; ++t) {
      float s[64] = {};
      shrink_scalar<E>(x.data() + t * k, a.data(), k, r, s);
      std::snprintf(what, sizeof what, "float32 shrink K %lld R %lld, scalar, token %d",
                    static_cast<long long>(k), static_cast<long long>(r), t);
      same(what, s, xa.data() + t * 64, r);
    }
  }

  // the expand: single columns from B (one token's form in lora_delta.cc) ...
  std::vector<float> stage(r * N), ref(T * N), got(T * N);
  for (int64_t i = 0; i < r * N; ++i) stage[i] = to_float(b[i]);
  for (int t = 0; t < T; ++t)
    for (int64_t c = 0; c < N; ++c)
      ref[t * N + c] = expand_sum(xa.data() + t * 64, b.data() + c, N, r);
  for (int t = 0; t < T; ++t) emit(ref.data() + t * N, N);
  const auto check = [&](const char* name, int64_t cols) {
    for (int t = 0; t < T; ++t) {
      std::snprintf(what, sizeof what, "%s expand R %lld, %s, token %d", type,
                    static_cast<long long>(r), name, t);
      same(what, got.data() + t * N, ref.data() + t * N, cols);
    }
  };
  // ... and from the float32 stage (a run of several tokens), single columns
  for (int t = 0; t < T; ++t)
    for (int64_t c = 0; c < N; ++c)
      got[t * N + c] = expand_sum(xa.data() + t * 64, stage.data() + c, N, r);
  check("single columns of the stage", N);
  // 16-column vectors, from B and from the stage, in lora_delta.cc's blocks
  const int64_t vec_cols = N / LANES * LANES;
  expand_blocks<E, 1, 16>(xa, b.data(), r, vec_cols, got);
  expand_blocks<E, 1, 1>(xa, b.data(), r, vec_cols, got);
  check("one token, vectors", 12 * LANES);
  expand_blocks<float, 8, 2>(xa, stage.data(), r, vec_cols, got);
  check("8 tokens, vectors of the stage", vec_cols);
  expand_blocks<float, 4, 4>(xa, stage.data(), r, vec_cols, got);
  check("4 tokens, vectors of the stage", vec_cols);
  expand_blocks<float, 2, 8>(xa, stage.data(), r, vec_cols, got);
  check("2 tokens, vectors of the stage", vec_cols);

  // the applied delta: apply_columns (row_gemm_lora.cc's epilogue) = add_to of each
  // column's scaled sum (lora_delta.cc's store1)
  const float sc = 0.75f;
  std::vector<E> y(T * N), want(T * N);
  for (auto& v : y) v = element<E>(uniform() * 4.0f);
  want = y;
  for (int t = 0; t < T; ++t) {
    apply_columns(xa.data() + t * 64, b.data(), N, r, N, sc, y.data() + t * N);
    for (int64_t c = 0; c < N; ++c) add_to(want.data() + t * N + c, scaled(ref[t * N + c], sc));
  }
  std::vector<float> yf(T * N), wf(T * N);
  for (int64_t i = 0; i < T * N; ++i) {
    yf[i] = to_float(y[i]);
    wf[i] = to_float(want[i]);
  }
  for (int t = 0; t < T; ++t) {
    std::snprintf(what, sizeof what, "%s applied delta R %lld, token %d", type,
                  static_cast<long long>(r), t);
    same(what, yf.data() + t * N, wf.data() + t * N, N);
  }
  emit_elements(y.data(), T * N);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  for (const int64_t k : {96, 103, 1601}) {
    for (const int64_t r : {12, 16, 32}) {
      probe<float>(k, r);
      probe<uint16_t>(k, r);
    }
  }
  emitted.insert(emitted.begin(), multiserve::float_ops::FUSED ? 1u : 0u);
  FILE* f = std::fopen(argv[1], "wb");
  if (f == nullptr) return 2;
  std::fwrite(emitted.data(), sizeof(uint32_t), emitted.size(), f);
  std::fclose(f);
  return failures == 0 ? 0 : 1;
}
