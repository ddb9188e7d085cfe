// Every SIMD path of Adam/AdamW against the scalar reference: sizes around the
// vector widths, misaligned starts, 100 steps with an lr that changes each
// step, tiny and huge gradients, f32/bf16/f16 gradients, gradient scale, and
// bf16/f16 copy-out equal to base's rounding of the fp32 master. Bitwise.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "kernels/cpu/adam.h"
#include "kernels/cpu/parallel.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

enum class Magnitude { kNormal, kTiny, kHuge };

struct Variant {
  AdamMode mode;
  DType grad;
  bool copy;
  DType copy_dtype;
  Magnitude magnitude;
};

std::string Name(const Variant& v) {
  const char* mags[] = {"normal", "tiny", "huge"};
  return std::string(v.mode == AdamMode::kAdamW ? "adamw" : "adam") + " grad=" +
         DTypeName(v.grad) + " copy=" + (v.copy ? DTypeName(v.copy_dtype) : "none") + " " +
         mags[static_cast<int>(v.magnitude)];
}

// Gradient scale of the magnitude; f16 cannot hold 1e30 or 1e-30.
float MagnitudeScale(Magnitude m, DType grad) {
  if (m == Magnitude::kTiny) return grad == DType::kF16 ? 1e-6f : 1e-30f;
  if (m == Magnitude::kHuge) return grad == DType::kF16 ? 3e3f : 1e30f;
  return 1.0f;
}

// One optimizer state of n elements whose arrays start at different
// misalignments (offset .. offset+4, mod 16 floats).
struct State {
  State(size_t n, size_t offset, DType grad_dtype, DType copy_dtype)
      : p(n, 4, offset % 16), m(n, 4, (offset + 1) % 16), v(n, 4, (offset + 2) % 16),
        g(n, DTypeSize(grad_dtype), (offset + 3) % 16), c(n, 2, (offset + 4) % 16) {
    Rng rng(n * 131 + offset);
    for (size_t i = 0; i < n; ++i) {
      p.as<float>()[i] = rng.Spread();
      m.as<float>()[i] = 0.0f;
      v.as<float>()[i] = 0.0f;
    }
    (void)copy_dtype;
  }
  Buffer p, m, v, g, c;
};

void FillGrad(State& s, size_t n, DType dtype, float scale, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < n; ++i) StoreAs(dtype, s.g.data(), i, rng.Spread() * scale);
}

void ExpectCopyIsRoundedMaster(const Variant& var, State& s, size_t n) {
  const float* p = s.p.as<float>();
  const uint16_t* c = s.c.as<uint16_t>();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t want = var.copy_dtype == DType::kBF16 ? F32ToBF16(p[i]) : F32ToF16(p[i]);
    ASSERT_EQ(c[i], want) << Name(var) << " element " << i << " of " << n;
  }
}

// Runs `steps` steps on the scalar path and on `isa`, comparing after each.
void CompareRun(CpuIsa isa, const Variant& var, size_t n, size_t offset, int steps) {
  State ref(n, offset, var.grad, var.copy_dtype), simd(n, offset + 5, var.grad, var.copy_dtype);
  std::memcpy(simd.p.data(), ref.p.data(), n * 4);
  const float mag = MagnitudeScale(var.magnitude, var.grad);
  for (int t = 1; t <= steps; ++t) {
    AdamOptions opt;
    opt.mode = var.mode;
    opt.lr = 1e-3 * (1.0 + 0.5 * std::sin(t));  // changes every step
    opt.weight_decay = 0.01;
    opt.step = t;
    opt.grad_scale = t % 3 == 0 ? 1.0 : 1.0 / (1024.0 + t);  // 1/loss_scale × clip
    opt.grad_dtype = var.grad;
    opt.param_copy_dtype = var.copy_dtype;
    FillGrad(ref, n, var.grad, mag, n * 1000 + t);
    std::memcpy(simd.g.data(), ref.g.data(), n * DTypeSize(var.grad));
    ASSERT_TRUE(AdamStepOn(CpuIsa::kScalar, opt, n, ref.p.as<float>(), ref.m.as<float>(),
                           ref.v.as<float>(), ref.g.data(), var.copy ? ref.c.data() : nullptr)
                    .ok());
    const Status st = AdamStepOn(isa, opt, n, simd.p.as<float>(), simd.m.as<float>(),
                                 simd.v.as<float>(), simd.g.data(), var.copy ? simd.c.data() : nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
    const std::string where = Name(var) + " path=" + CpuIsaName(isa) + " n=" +
                              std::to_string(n) + " offset=" + std::to_string(offset) +
                              " step=" + std::to_string(t);
    ASSERT_EQ(FirstDiff(ref.p.as<float>(), simd.p.as<float>(), n), -1) << "param " << where;
    ASSERT_EQ(FirstDiff(ref.m.as<float>(), simd.m.as<float>(), n), -1) << "exp_avg " << where;
    ASSERT_EQ(FirstDiff(ref.v.as<float>(), simd.v.as<float>(), n), -1) << "exp_avg_sq " << where;
    if (var.copy) {
      ASSERT_NO_FATAL_FAILURE(ExpectCopyIsRoundedMaster(var, simd, n)) << where;
      ASSERT_NO_FATAL_FAILURE(ExpectCopyIsRoundedMaster(var, ref, n)) << where;
    }
  }
}

std::vector<Variant> AllVariants() {
  std::vector<Variant> all;
  for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 3; ++copy)
        for (Magnitude mag : {Magnitude::kNormal, Magnitude::kTiny, Magnitude::kHuge})
          all.push_back({mode, g, copy > 0, copy == 2 ? DType::kF16 : DType::kBF16, mag});
  return all;
}

TEST(AdamPaths, SmallSizesAllVariantsMisaligned) {
  for (CpuIsa isa : SimdPathsHere())
    for (const Variant& var : AllVariants())
      for (size_t n : {1, 7, 15, 16, 17, 1023, 1024, 1025})
        for (size_t offset : {0, 1, 7, 15})
          ASSERT_NO_FATAL_FAILURE(CompareRun(isa, var, n, offset, 100));
}

TEST(AdamPaths, LargeSizeManyTiles) {
  const size_t n = (1u << 20) + 3;
  for (CpuIsa isa : SimdPathsHere()) {
    ASSERT_NO_FATAL_FAILURE(CompareRun(
        isa, {AdamMode::kAdamW, DType::kF32, false, DType::kBF16, Magnitude::kNormal}, n, 3, 100));
    ASSERT_NO_FATAL_FAILURE(CompareRun(
        isa, {AdamMode::kAdam, DType::kBF16, true, DType::kBF16, Magnitude::kHuge}, n, 9, 100));
    ASSERT_NO_FATAL_FAILURE(CompareRun(
        isa, {AdamMode::kAdamW, DType::kF16, true, DType::kF16, Magnitude::kTiny}, n, 14, 100));
  }
}

TEST(AdamPaths, ResultDoesNotDependOnThreadCount) {
  const size_t n = (1u << 20) + 3;
  State one(n, 1, DType::kF32, DType::kBF16), many(n, 1, DType::kF32, DType::kBF16);
  FillGrad(one, n, DType::kF32, 1.0f, 7);
  std::memcpy(many.g.data(), one.g.data(), n * 4);
  AdamOptions opt;
  opt.weight_decay = 0.01;
  SetCpuKernelThreads(1);
  ASSERT_TRUE(AdamStep(opt, n, one.p.as<float>(), one.m.as<float>(), one.v.as<float>(),
                       one.g.data(), nullptr).ok());
  SetCpuKernelThreads(0);
  ASSERT_TRUE(AdamStep(opt, n, many.p.as<float>(), many.m.as<float>(), many.v.as<float>(),
                       many.g.data(), nullptr).ok());
  EXPECT_EQ(FirstDiff(one.p.as<float>(), many.p.as<float>(), n), -1);
}

// The SIMD paths divide sqrt(v) by sqrt(1 - beta2^t) with a reciprocal and an
// FMA correction (step_scalars.h). With g = 0 and eps = 0 the update exposes
// that quotient directly; sweep v over every mantissa of two binades (so
// sqrt(v) covers every mantissa; STRATA_EXHAUSTIVE=1) or, by default, every
// 16th with its low bits varied (both binades, each mantissa's top 20 bits),
// and several bias corrections.
TEST(AdamPaths, DivisionByBiasCorrectionMatchesReference) {
  const size_t stride = Exhaustive() ? 1 : 16;
  const size_t n = (size_t{1} << 24) / stride;
  std::vector<float> v0(n), zero(n, 0.0f);
  for (size_t i = 0; i < n; ++i)
    v0[i] = BitsF32(0x3f000000u + static_cast<uint32_t>(i * stride + (i * 7) % stride));
  v0[0] = std::numeric_limits<float>::infinity();
  v0[1] = 0.0f;
  for (CpuIsa isa : SimdPathsHere())
    for (int64_t t : {1, 2, 3, 10, 100, 1000})
      for (double beta2 : {0.999, 0.95}) {
        AdamOptions opt;
        opt.eps = 0.0;
        opt.beta2 = beta2;
        opt.step = t;
        std::vector<float> p[2] = {std::vector<float>(n, 1.0f), std::vector<float>(n, 1.0f)};
        std::vector<float> m[2] = {std::vector<float>(n, 1.0f), std::vector<float>(n, 1.0f)};
        std::vector<float> v[2] = {v0, v0};
        for (int k = 0; k < 2; ++k)
          ASSERT_TRUE(AdamStepOn(k ? isa : CpuIsa::kScalar, opt, n, p[k].data(), m[k].data(),
                                 v[k].data(), zero.data(), nullptr).ok());
        ASSERT_EQ(FirstDiff(p[0].data(), p[1].data(), n), -1)
            << CpuIsaName(isa) << " step " << t << " beta2 " << beta2;
      }
}

TEST(AdamOptions, BadOptionsAreRefused) {
  float p = 0, m = 0, v = 0, g = 0;
  AdamOptions opt;
  opt.step = 0;
  EXPECT_EQ(AdamStep(opt, 1, &p, &m, &v, &g, nullptr).code(), Code::kInvalid);
  opt.step = 1;
  opt.beta2 = 1.0;
  EXPECT_EQ(AdamStep(opt, 1, &p, &m, &v, &g, nullptr).code(), Code::kInvalid);
  opt.beta2 = 0.999;
  opt.param_copy_dtype = DType::kF32;
  EXPECT_EQ(AdamStep(opt, 1, &p, &m, &v, &g, &p).code(), Code::kInvalid);
}

TEST(AdamOptions, MissingPathIsRefusedNotRun) {
  float p = 0, m = 0, v = 0, g = 0;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) continue;
    EXPECT_EQ(AdamStepOn(isa, AdamOptions{}, 1, &p, &m, &v, &g, nullptr).code(),
              Code::kUnsupported);
  }
}

}  // namespace
}  // namespace strata::kernels::test

int main(int argc, char** argv) { return strata::kernels::test::RunPathTests(argc, argv); }
