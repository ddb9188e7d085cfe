// Every SIMD path of Lion and Adagrad against the scalar reference: sizes
// around the vector widths, misaligned starts, 100 steps with an lr that
// changes each step, tiny and huge gradients, all gradient dtypes and copy-outs.
#include <gtest/gtest.h>

#include <string>

#include "kernels/cpu/adagrad.h"
#include "kernels/cpu/lion.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

struct Case {
  DType grad;
  int copy;  // 0 none, 1 bf16, 2 f16
  float magnitude;
};

std::vector<Case> Cases() {
  std::vector<Case> all;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
    for (int copy = 0; copy < 3; ++copy)
      for (float mag : {1.0f, 1e-30f, 1e30f}) {
        float m = mag;
        if (g == DType::kF16 && mag != 1.0f) m = mag < 1 ? 1e-6f : 3e3f;  // f16's range
        all.push_back({g, copy, m});
      }
  return all;
}

std::string Where(const char* what, CpuIsa isa, const Case& c, size_t n, size_t off, int t) {
  return std::string(what) + " path=" + CpuIsaName(isa) + " grad=" + DTypeName(c.grad) +
         " copy=" + std::to_string(c.copy) + " mag=" + std::to_string(c.magnitude) +
         " n=" + std::to_string(n) + " offset=" + std::to_string(off) + " step=" + std::to_string(t);
}

// Two copies (reference and SIMD) of param, one state array, grad and copy.
struct Pair {
  Pair(size_t n, size_t off, DType g)
      : p{Buffer(n, 4, off % 16), Buffer(n, 4, (off + 5) % 16)},
        s{Buffer(n, 4, (off + 1) % 16), Buffer(n, 4, (off + 6) % 16)},
        g(n, DTypeSize(g), (off + 2) % 16),
        c{Buffer(n, 2, (off + 3) % 16), Buffer(n, 2, (off + 7) % 16)} {
    Rng rng(n + off);
    for (size_t i = 0; i < n; ++i) {
      p[0].as<float>()[i] = p[1].as<float>()[i] = rng.Spread();
      s[0].as<float>()[i] = s[1].as<float>()[i] = 0.0f;
    }
  }
  Buffer p[2], s[2], g, c[2];
};

void FillGrad(Pair& b, size_t n, DType dtype, float mag, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < n; ++i) StoreAs(dtype, b.g.data(), i, rng.Spread() * mag);
}

void ExpectPairEqual(Pair& b, size_t n, const Case& c, const std::string& where) {
  ASSERT_EQ(FirstDiff(b.p[0].as<float>(), b.p[1].as<float>(), n), -1) << "param " << where;
  ASSERT_EQ(FirstDiff(b.s[0].as<float>(), b.s[1].as<float>(), n), -1) << "state " << where;
  if (c.copy == 0) return;
  for (size_t i = 0; i < n; ++i) {
    const float p = b.p[1].as<float>()[i];
    ASSERT_EQ(b.c[1].as<uint16_t>()[i], c.copy == 1 ? F32ToBF16(p) : F32ToF16(p)) << where;
  }
}

void RunLion(CpuIsa isa, const Case& c, size_t n, size_t off) {
  Pair b(n, off, c.grad);
  for (int t = 1; t <= 100; ++t) {
    LionOptions o;
    o.lr = 1e-4 * (1.0 + 0.5 * std::cos(t));
    o.weight_decay = 0.1;
    o.grad_scale = t % 2 ? 1.0 : 0.25;
    o.grad_dtype = c.grad;
    o.param_copy_dtype = c.copy == 2 ? DType::kF16 : DType::kBF16;
    FillGrad(b, n, c.grad, c.magnitude, n * 7 + t);
    for (int k = 0; k < 2; ++k) {
      const Status st = LionStepOn(k == 0 ? CpuIsa::kScalar : isa, o, n, b.p[k].as<float>(),
                                   b.s[k].as<float>(), b.g.data(), c.copy ? b.c[k].data() : nullptr);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_NO_FATAL_FAILURE(ExpectPairEqual(b, n, c, Where("lion", isa, c, n, off, t)));
  }
}

void RunAdagrad(CpuIsa isa, const Case& c, size_t n, size_t off, double wd) {
  Pair b(n, off, c.grad);
  for (int t = 1; t <= 100; ++t) {
    AdagradOptions o;
    o.lr = 1e-2 * (1.0 + 0.5 * std::sin(t));
    o.lr_decay = 1e-3;
    o.weight_decay = wd;
    o.step = t;
    o.grad_scale = t % 2 ? 1.0 : 0.25;
    o.grad_dtype = c.grad;
    o.param_copy_dtype = c.copy == 2 ? DType::kF16 : DType::kBF16;
    FillGrad(b, n, c.grad, c.magnitude, n * 11 + t);
    for (int k = 0; k < 2; ++k) {
      const Status st = AdagradStepOn(k == 0 ? CpuIsa::kScalar : isa, o, n, b.p[k].as<float>(),
                                      b.s[k].as<float>(), b.g.data(), c.copy ? b.c[k].data() : nullptr);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_NO_FATAL_FAILURE(ExpectPairEqual(b, n, c, Where("adagrad", isa, c, n, off, t)));
  }
}

const size_t kSizes[] = {1, 7, 15, 16, 17, 1023, 1024, 1025};

TEST(LionPaths, MatchScalarReference) {
  for (CpuIsa isa : SimdPathsHere()) {
    for (const Case& c : Cases())
      for (size_t n : kSizes)
        for (size_t off : {0, 3, 15}) ASSERT_NO_FATAL_FAILURE(RunLion(isa, c, n, off));
    ASSERT_NO_FATAL_FAILURE(RunLion(isa, {DType::kBF16, 1, 1.0f}, (1u << 20) + 3, 1));
  }
}

TEST(LionPaths, SignOfZeroAndNaN) {
  // c = 0 leaves p unchanged; a NaN gradient makes a NaN param on every path.
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuSupports(isa)) continue;
    float p[3] = {1.0f, 1.0f, 1.0f}, m[3] = {0.0f, 0.0f, 0.0f};
    const float g[3] = {0.0f, std::nanf(""), -2.0f};
    LionOptions o;
    o.lr = 0.5;
    ASSERT_TRUE(LionStepOn(isa, o, 3, p, m, g, nullptr).ok());
    EXPECT_EQ(p[0], 1.0f) << CpuIsaName(isa);
    EXPECT_TRUE(std::isnan(p[1])) << CpuIsaName(isa);
    EXPECT_EQ(p[2], 1.5f) << CpuIsaName(isa);
  }
}

TEST(AdagradPaths, MatchScalarReference) {
  for (CpuIsa isa : SimdPathsHere()) {
    for (const Case& c : Cases())
      for (size_t n : kSizes)
        for (size_t off : {0, 3, 15})
          for (double wd : {0.0, 0.01}) ASSERT_NO_FATAL_FAILURE(RunAdagrad(isa, c, n, off, wd));
    ASSERT_NO_FATAL_FAILURE(RunAdagrad(isa, {DType::kF16, 2, 1.0f}, (1u << 20) + 3, 2, 0.01));
  }
}

}  // namespace
}  // namespace strata::kernels::test

int main(int argc, char** argv) { return strata::kernels::test::RunPathTests(argc, argv); }
