// Every SIMD path of Adam/AdamW against the scalar reference: sizes around the
// vector widths, misaligned starts, 100 steps with an lr that changes each
// step, tiny and huge gradients, f32/bf16/f16 gradients, gradient scale, and
// bf16/f16 copy-out equal to base's rounding of the fp32 master. Bitwise.
// Both first-moment formulas (MomentUpdate: mul_add, lerp with either weight
// branch) on every path, the scalar one included, against a reference of
// each formula written out here from torch's definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

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
  MomentUpdate moment = MomentUpdate::kMulAdd;
  double beta1 = 0.9;
};

std::string Name(const Variant& v) {
  const char* mags[] = {"normal", "tiny", "huge"};
  return std::string(v.mode == AdamMode::kAdamW ? "adamw" : "adam") + " grad=" +
         DTypeName(v.grad) + " copy=" + (v.copy ? DTypeName(v.copy_dtype) : "none") + " " +
         mags[static_cast<int>(v.magnitude)] + " moment_update=" + MomentUpdateName(v.moment) +
         " beta1=" + std::to_string(v.beta1);
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
    opt.moment_update = var.moment;
    opt.beta1 = var.beta1;
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

// The lerp first moment on every variant, both weight branches (beta1 0.9:
// w = 0.1; beta1 0.3: w = 0.7), sizes around both vector widths.
TEST(AdamPaths, LerpAllVariantsMisaligned) {
  const std::vector<Variant> all = AllVariants();
  for (CpuIsa isa : SimdPathsHere())
    for (size_t k = 0; k < all.size(); ++k) {
      Variant var = all[k];
      var.moment = MomentUpdate::kLerp;
      var.beta1 = k % 2 ? 0.3 : 0.9;
      for (size_t n : {1, 7, 15, 16, 17, 1025})
        for (size_t offset : {0, 7}) ASSERT_NO_FATAL_FAILURE(CompareRun(isa, var, n, offset, 20));
    }
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
    ASSERT_NO_FATAL_FAILURE(CompareRun(
        isa, {AdamMode::kAdamW, DType::kBF16, true, DType::kBF16, Magnitude::kNormal, MomentUpdate::kLerp}, n, 5,
        20));
  }
}

// ---- The first moment's formulas, from torch's definitions ----

// exp_avg after one step of torch's code, rounding for rounding (w and beta1
// are float in torch's float kernels; a fused multiply-add where torch's
// kernel has one):
//   mul_add (torch 1.x): exp_avg.mul_(beta1).add_(grad, alpha=1-beta1)
//   lerp (torch >= 2.0): exp_avg.lerp_(grad, 1-beta1), that is
//     self + w*(end - self)          for |w| < 0.5
//     end - (end - self)*(1 - w)     otherwise
float RefFirstMoment(MomentUpdate u, double beta1, float m, float g) {
  const float w = static_cast<float>(1.0 - beta1);
  if (u == MomentUpdate::kMulAdd) return std::fma(w, g, m * static_cast<float>(beta1));
  const float d = g - m;
  if (std::fabs(w) < 0.5f) return std::fma(w, d, m);
  return std::fma(-d, 1.0f - w, g);
}

// One Adam/AdamW step of torch.optim's single-tensor code on fp32 gradients:
// the scalars in double rounded once to float, then per element
//   g *= grad_scale; Adam: g = g + wd*p (add_ with alpha: an FMA); AdamW: p *= 1 - lr*wd
//   m = RefFirstMoment;  v = v*b2 + (1-b2)*g*g (addcmul_: one FMA)
//   p = p + (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)   (addcdiv_)
void RefAdamStep(const AdamOptions& o, size_t n, float* p, float* m, float* v, const float* g_in) {
  const double t = static_cast<double>(o.step);
  const bool adamw = o.mode == AdamMode::kAdamW;
  const float scale = static_cast<float>(o.grad_scale);
  const float decay = adamw ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f;
  const float wd = static_cast<float>(o.weight_decay);
  const float b2 = static_cast<float>(o.beta2), w2 = static_cast<float>(1.0 - o.beta2);
  const float sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, t)));
  const float neg_step = static_cast<float>(-o.lr / (1.0 - std::pow(o.beta1, t)));
  const float eps = static_cast<float>(o.eps);
  for (size_t i = 0; i < n; ++i) {
    float g = g_in[i] * scale;
    if (!adamw && o.weight_decay != 0) g = std::fma(p[i], wd, g);
    const float pd = p[i] * decay;
    m[i] = RefFirstMoment(o.moment_update, o.beta1, m[i], g);
    v[i] = std::fma(w2 * g, g, v[i] * b2);
    p[i] = pd + (neg_step * m[i]) / (std::sqrt(v[i]) / sqrt_bc2 + eps);
  }
}

// A state with moments of a few steps' worth (non-zero m: from m = 0 the two
// formulas agree on the first step).
struct RefState {
  RefState(size_t n, uint64_t seed) : p(n), m(n), v(n) {
    Rng rng(seed);
    for (size_t i = 0; i < n; ++i) {
      p[i] = rng.Spread();
      m[i] = i % 9 == 4 ? 0.0f : 0.05f * rng.Spread();
      const float g = rng.Spread();
      v[i] = i % 13 == 6 ? 0.0f : 1e-3f * g * g;
    }
  }
  std::vector<float> p, m, v;
};

std::vector<CpuIsa> AllPathsHere() {
  std::vector<CpuIsa> paths = {CpuIsa::kScalar};
  for (CpuIsa isa : SimdPathsHere()) paths.push_back(isa);
  return paths;
}

// Every path (scalar too), each formula, both lerp branches (w = 1 - beta1:
// 0.1, 0.001, 0.4 small; 0.5, 0.7, 1 large), both modes, lengths around the
// vector widths (body and tail), several steps: bitwise the reference.
TEST(AdamMoment, EveryPathMatchesTheFormulaReference) {
  for (CpuIsa isa : AllPathsHere())
    for (MomentUpdate u : {MomentUpdate::kMulAdd, MomentUpdate::kLerp})
      for (double beta1 : {0.9, 0.999, 0.6, 0.5, 0.3, 0.0})
        for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
          for (size_t n : {1, 5, 8, 9, 15, 16, 17, 31, 33, 100, 1031}) {
            RefState ref(n, n * 17 + 3), got = ref;
            std::vector<float> g(n);
            for (int t = 1; t <= 4; ++t) {
              Rng rng(n * 1000 + t);
              for (float& x : g) x = rng.Spread();
              AdamOptions opt;
              opt.mode = mode;
              opt.lr = 1e-2 * (1.0 + 0.5 * std::sin(t));
              opt.beta1 = beta1;
              opt.weight_decay = 0.05;
              opt.step = t;
              opt.grad_scale = t == 2 ? 0.25 : 1.0;
              opt.moment_update = u;
              RefAdamStep(opt, n, ref.p.data(), ref.m.data(), ref.v.data(), g.data());
              ASSERT_TRUE(AdamStepOn(isa, opt, n, got.p.data(), got.m.data(), got.v.data(), g.data(), nullptr).ok());
              const std::string where = std::string(CpuIsaName(isa)) + " " + MomentUpdateName(u) + " beta1=" +
                                        std::to_string(beta1) + (mode == AdamMode::kAdam ? " adam" : " adamw") +
                                        " n=" + std::to_string(n) + " step=" + std::to_string(t);
              ASSERT_EQ(FirstDiff(ref.m.data(), got.m.data(), n), -1) << "exp_avg " << where;
              ASSERT_EQ(FirstDiff(ref.v.data(), got.v.data(), n), -1) << "exp_avg_sq " << where;
              ASSERT_EQ(FirstDiff(ref.p.data(), got.p.data(), n), -1) << "param " << where;
            }
          }
}

// The option is not ignored: lerp and mul_add give different moments (and
// so weights), and each lerp branch is the one torch takes: the other
// branch's formula differs somewhere on the same data. Every path.
TEST(AdamMoment, FormulasAndBranchesDiffer) {
  const size_t n = 4099;
  for (CpuIsa isa : AllPathsHere())
    for (double beta1 : {0.9, 0.3}) {
      const RefState start(n, 11);
      std::vector<float> g(n);
      Rng rng(5);
      for (float& x : g) x = rng.Spread();
      AdamOptions opt;
      opt.beta1 = beta1;
      opt.step = 3;
      RefState mul = start, lerp = start;
      ASSERT_TRUE(AdamStepOn(isa, opt, n, mul.p.data(), mul.m.data(), mul.v.data(), g.data(), nullptr).ok());
      opt.moment_update = MomentUpdate::kLerp;
      ASSERT_TRUE(AdamStepOn(isa, opt, n, lerp.p.data(), lerp.m.data(), lerp.v.data(), g.data(), nullptr).ok());
      const float w = static_cast<float>(1.0 - beta1);
      size_t moments_differ = 0, params_differ = 0, other_branch_differs = 0;
      for (size_t i = 0; i < n; ++i) {
        moments_differ += !SameFloat(mul.m[i], lerp.m[i]);
        params_differ += !SameFloat(mul.p[i], lerp.p[i]);
        const float d = g[i] - start.m[i];
        const float other = w < 0.5f ? std::fma(-d, 1.0f - w, g[i]) : std::fma(w, d, start.m[i]);
        other_branch_differs += !SameFloat(other, lerp.m[i]);
      }
      const std::string where = std::string(CpuIsaName(isa)) + " beta1=" + std::to_string(beta1);
      EXPECT_GT(moments_differ, n / 100) << where;
      EXPECT_GT(params_differ, 0u) << where;
      EXPECT_GT(other_branch_differs, n / 100) << where;
      std::printf("%s: lerp vs mul_add: %zu of %zu moments differ, %zu params; the other lerp branch: %zu\n",
                  where.c_str(), moments_differ, n, params_differ, other_branch_differs);
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
  opt.param_copy_dtype = DType::kBF16;
  opt.moment_update = static_cast<MomentUpdate>(7);
  const Status st = AdamStep(opt, 1, &p, &m, &v, &g, nullptr);
  EXPECT_EQ(st.code(), Code::kInvalid);
  EXPECT_NE(st.message().find("moment_update"), std::string::npos) << st.ToString();
}

TEST(AdamOptions, MomentUpdateNames) {
  for (MomentUpdate u : {MomentUpdate::kMulAdd, MomentUpdate::kLerp}) {
    const Result<MomentUpdate> back = ParseMomentUpdate(MomentUpdateName(u));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back.value(), u);
  }
  const Result<MomentUpdate> bad = ParseMomentUpdate("lerp2");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("mul_add, lerp"), std::string::npos) << bad.status().ToString();
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
