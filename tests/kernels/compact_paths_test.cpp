// Every SIMD path of the compact Adam/AdamW step (and of the fp32 <-> compact
// conversions) against the scalar reference, bitwise: sizes around the block and vector widths (partial last blocks),
// misaligned arrays, 30 steps with an lr that changes each step, tiny, huge
// and non-finite gradients, f32/bf16/f16 gradients, every copy-out, and thread
// counts. Both first-moment formulas (MomentUpdate), both lerp branches.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/compact.h"
#include "kernels/cpu/lion.h"
#include "kernels/cpu/parallel.h"
#include "tests/kernels/compact_test_util.h"

namespace strata::kernels::test {
namespace {

struct Variant {
  AdamMode mode;
  DType grad;
  int copy;  // 0 none, 1 bf16, 2 f16, 3 f32
  float magnitude;
  MomentUpdate moment = MomentUpdate::kMulAdd;
  double beta1 = 0.9;
};

DType CopyDType(int copy) { return copy == 1 ? DType::kBF16 : copy == 2 ? DType::kF16 : DType::kF32; }

std::string Name(const Variant& v) {
  return std::string(v.mode == AdamMode::kAdamW ? "adamw" : "adam") + " grad=" + DTypeName(v.grad) +
         " copy=" + (v.copy ? DTypeName(CopyDType(v.copy)) : "none") +
         " magnitude=" + std::to_string(v.magnitude) + " moment_update=" + MomentUpdateName(v.moment) +
         " beta1=" + std::to_string(v.beta1);
}

// A packed random state: weights over several binades, moments of a few
// steps' worth, some elements exactly zero.
void FillState(CompactBuffers& c, size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> w(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    w[i] = rng.Spread();
    m[i] = i % 11 == 0 ? 0.0f : 0.01f * rng.Spread();
    const float g = rng.Spread();
    v[i] = i % 13 == 0 ? 0.0f : 1e-3f * g * g;
  }
  ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), c.state()).ok());
}

void FillGrad(Buffer& g, size_t n, DType dtype, float magnitude, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < n; ++i) StoreAs(dtype, g.data(), i, rng.Spread() * magnitude);
}

AdamOptions Options(const Variant& var, int t) {
  AdamOptions opt;
  opt.mode = var.mode;
  opt.lr = 1e-3 * (1.0 + 0.5 * std::sin(t));
  opt.weight_decay = 0.01;
  opt.step = t;
  opt.grad_scale = t % 3 == 0 ? 1.0 : 1.0 / (1024.0 + t);
  opt.grad_dtype = var.grad;
  opt.param_copy_dtype = CopyDType(var.copy);
  opt.moment_update = var.moment;
  opt.beta1 = var.beta1;
  return opt;
}

// `steps` steps on the scalar path and on `isa`, comparing after each.
void CompareRun(CpuIsa isa, const Variant& var, size_t n, size_t offset, int steps) {
  CompactBuffers ref(n, offset), simd(n, offset + 5);
  ASSERT_NO_FATAL_FAILURE(FillState(ref, n, n * 7 + offset));
  simd.CopyFrom(ref);
  const size_t gb = DTypeSize(var.grad), cb = var.copy ? DTypeSize(CopyDType(var.copy)) : 0;
  Buffer g(n, gb, (offset + 6) % 16), gs(n, gb, (offset + 9) % 16);
  Buffer c_ref(n, 4, (offset + 7) % 16), c_simd(n, 4, (offset + 8) % 16);
  for (int t = 1; t <= steps; ++t) {
    FillGrad(g, n, var.grad, var.magnitude, n * 1000 + t);
    if (t == steps && n > 40) StoreAs(var.grad, g.data(), 37, std::nanf(""));  // a NaN block
    std::memcpy(gs.data(), g.data(), n * gb);
    const AdamOptions opt = Options(var, t);
    ASSERT_TRUE(
        CompactAdamStepOn(CpuIsa::kScalar, opt, n, ref.state(), g.data(), var.copy ? c_ref.data() : nullptr)
            .ok());
    const Status st =
        CompactAdamStepOn(isa, opt, n, simd.state(), gs.data(), var.copy ? c_simd.data() : nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
    const std::string where = Name(var) + " path=" + CpuIsaName(isa) + " n=" + std::to_string(n) +
                              " offset=" + std::to_string(offset) + " step=" + std::to_string(t);
    ASSERT_EQ(CompactDiff(ref, simd), "") << where;
    if (cb) {
      ASSERT_EQ(std::memcmp(c_ref.data(), c_simd.data(), n * cb), 0) << "copy " << where;
    }
    if (var.copy == 1) {
      ASSERT_EQ(std::memcmp(c_ref.data(), ref.state().w_hi, n * 2), 0) << where;
    }
  }
}

std::vector<Variant> AllVariants() {
  std::vector<Variant> all;
  for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 4; ++copy)
        for (float mag : {1.0f, 1e-6f, 3e3f}) all.push_back({mode, g, copy, mag});
  return all;
}

// fp32 input for the conversions: weights over many binades with every
// special (±0, subnormals, the top floats past bf16's range, ±inf, NaN);
// moments with blocks that hold an inf, a NaN, a negative v, only zeros, or
// only values below kCompactMinScale.
void FillFp32(std::vector<float>& w, std::vector<float>& m, std::vector<float>& v, uint64_t seed) {
  Rng rng(seed);
  const float specials[] = {0.0f, -0.0f, 1e-45f, -3e-39f, 0x1.fffffep127f, -0x1.ff8p127f, INFINITY, -INFINITY,
                            std::nanf("")};
  for (size_t i = 0; i < w.size(); ++i) {
    const size_t block = i / kCompactBlock;
    w[i] = i % 17 == 5 ? specials[(i / 17) % 9] : std::ldexp(rng.Spread(), static_cast<int>(rng.Next() % 80) - 40);
    m[i] = 0.01f * rng.Spread();
    const float g = rng.Spread();
    v[i] = 1e-3f * g * g;
    switch (block % 9) {
      case 2: if (i % kCompactBlock == 3) m[i] = INFINITY; break;
      case 3: if (i % kCompactBlock == 9) v[i] = std::nanf(""); break;
      case 4: if (i % kCompactBlock == 1) v[i] = -1e-3f; break;
      case 5: m[i] = 0.0f, v[i] = 0.0f; break;
      case 6: m[i] *= 1e-35f; break;
      case 7: v[i] = i % 2 ? 0.0f : v[i]; break;  // zero v codes force m codes to 0
      default: break;
    }
  }
}

// CompactPack and CompactUnpack on each SIMD path against the scalar
// reference, bitwise, with (Adam) and without (Lion) v, misaligned, with
// partial last blocks and across tiles.
TEST(CompactPaths, PackAndUnpackEqualTheReference) {
  for (CpuIsa isa : SimdPathsHere())  // both SIMD paths convert in AVX2 vectors, verified here
    for (size_t n : {size_t{1}, size_t{7}, size_t{31}, size_t{32}, size_t{33}, size_t{95}, size_t{1025},
                     (size_t{1} << 18) + 19})
      for (bool lion : {false, true})
        for (size_t offset : {size_t{0}, size_t{3}}) {
          const std::string where = std::string(CpuIsaName(isa)) + " n=" + std::to_string(n) +
                                    (lion ? " lion" : " adam") + " offset=" + std::to_string(offset);
          std::vector<float> w(n + offset), m(n + offset), v(n + offset);
          FillFp32(w, m, v, n + offset);
          const float* vin = lion ? nullptr : v.data() + offset;
          CompactBuffers ref(n, offset), simd(n, offset + 5);
          CompactState rs = ref.state(), ss = simd.state();
          if (lion) rs.v_code = ss.v_code = nullptr, rs.v_scale = ss.v_scale = nullptr;
          ASSERT_TRUE(CompactPackOn(CpuIsa::kScalar, n, w.data() + offset, m.data() + offset, vin, rs).ok());
          const Status st = CompactPackOn(isa, n, w.data() + offset, m.data() + offset, vin, ss);
          ASSERT_TRUE(st.ok()) << st.ToString();
          ASSERT_EQ(CompactDiff(ref, simd), "") << "pack " << where;
          std::vector<float> w1(n), m1(n), v1(n, 7.0f), w2(n), m2(n), v2(n, 7.0f);
          ASSERT_TRUE(CompactUnpackOn(CpuIsa::kScalar, n, rs, w1.data(), m1.data(), lion ? nullptr : v1.data()).ok());
          ASSERT_TRUE(CompactUnpackOn(isa, n, ss, w2.data(), m2.data(), lion ? nullptr : v2.data()).ok());
          ASSERT_EQ(FirstDiff(w1.data(), w2.data(), n), -1) << "unpack w " << where;
          ASSERT_EQ(FirstDiff(m1.data(), m2.data(), n), -1) << "unpack m " << where;
          ASSERT_EQ(FirstDiff(v1.data(), v2.data(), n), -1) << "unpack v " << where;
        }
}

// A state Split never writes (a corrupt or foreign one): hi = +-0 with a
// negative correction rebuilds to a NaN, the same bits on every path. The
// scalar keeps hi's sign and adds to the magnitude; the SIMD paths added to
// the whole word, and the NaN took the other sign.
TEST(CompactPaths, RebuildOfAZeroWithANegativeCorrectionIsThePathsOwn) {
  for (CpuIsa isa : CompactSimdPaths()) {
    const size_t n = 96;
    CompactBuffers a(n, 0), b(n, 3);
    CompactState sa = a.state(), sb = b.state();
    for (size_t i = 0; i < n; ++i) {
      sa.w_hi[i] = sb.w_hi[i] = i % 2 ? 0x8000 : 0x0000;  // -0, +0
      sa.w_lo[i] = sb.w_lo[i] = static_cast<int8_t>(-1 - static_cast<int>(i % 128));
      sa.m_code[i] = sb.m_code[i] = 0;
      sa.v_code[i] = sb.v_code[i] = 0;
    }
    for (size_t k = 0; k < CompactScaleCount(n); ++k) sa.m_scale[k] = sb.m_scale[k] = sa.v_scale[k] = sb.v_scale[k] = 1.0f;
    std::vector<float> w1(n), m1(n), v1(n), w2(n), m2(n), v2(n);
    ASSERT_TRUE(CompactUnpackOn(CpuIsa::kScalar, n, sa, w1.data(), m1.data(), v1.data()).ok());
    ASSERT_TRUE(CompactUnpackOn(isa, n, sb, w2.data(), m2.data(), v2.data()).ok());
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(F32Bits(w1[i]), F32Bits(w2[i])) << CpuIsaName(isa) << " element " << i;
  }
}

TEST(CompactPaths, SmallSizesAllVariantsMisaligned) {
  for (CpuIsa isa : CompactSimdPaths())
    for (const Variant& var : AllVariants())
      for (size_t n : {1, 7, 16, 31, 32, 33, 47, 64, 95, 1025})
        for (size_t offset : {0, 1, 7}) ASSERT_NO_FATAL_FAILURE(CompareRun(isa, var, n, offset, 30));
}

// The lerp first moment, both weight branches (beta1 0.9: w = 0.1; 0.3: w = 0.7).
TEST(CompactPaths, LerpAllVariantsMisaligned) {
  const std::vector<Variant> all = AllVariants();
  for (CpuIsa isa : CompactSimdPaths())
    for (size_t k = 0; k < all.size(); ++k) {
      Variant var = all[k];
      var.moment = MomentUpdate::kLerp;
      var.beta1 = k % 2 ? 0.3 : 0.9;
      for (size_t n : {1, 7, 33, 95, 1025}) ASSERT_NO_FATAL_FAILURE(CompareRun(isa, var, n, k % 3, 10));
    }
}

TEST(CompactPaths, TinyAndHugeMagnitudes) {
  // f32 gradients far outside f16's range: moments below kCompactMinScale
  // (blocks stored as zeros) and near the top of the float range.
  for (CpuIsa isa : CompactSimdPaths())
    for (float mag : {1e-30f, 1e-20f, 1e15f})
      ASSERT_NO_FATAL_FAILURE(CompareRun(isa, {AdamMode::kAdamW, DType::kF32, 3, mag}, 1000 + 17, 3, 30));
}

TEST(CompactPaths, LargeSizeManyTiles) {
  const size_t n = (1u << 20) + 19;
  for (CpuIsa isa : CompactSimdPaths()) {
    ASSERT_NO_FATAL_FAILURE(CompareRun(isa, {AdamMode::kAdamW, DType::kBF16, 0, 1.0f}, n, 3, 5));
    ASSERT_NO_FATAL_FAILURE(CompareRun(isa, {AdamMode::kAdam, DType::kF32, 2, 1.0f}, n, 9, 5));
  }
}

// Masters at the edges of the split (every correction around zero and the
// subnormals, a binade crossing, the bf16 overflow, ±inf, NaN) through steps
// whose updates are a few fp32 ULPs there, so that new values land on them.
TEST(CompactPaths, EdgeMastersThroughTheStep) {
  std::vector<float> w, zero;
  for (uint32_t high : {0x0000u, 0x0080u, 0x3f7fu, 0x7f7fu})
    for (uint32_t sign : {0u, 0x80000000u})
      for (uint32_t low = 0; low < 0x10000u; low += 3) w.push_back(BitsF32(sign | (high << 16) | low));
  for (float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::nanf(""), 0.0f, -0.0f})
    w.push_back(x);
  const size_t n = w.size();
  zero.assign(n, 0.0f);
  CompactBuffers ref(n, 0), simd(n, 1);
  ASSERT_TRUE(CompactPack(n, w.data(), zero.data(), zero.data(), ref.state()).ok());
  Buffer g(n, 4, 0);
  FillGrad(g, n, DType::kF32, 1.0f, 5);
  AdamOptions opt;
  // Steps of a few fp32 ULPs at the subnormals, at 1 and at 2^127.
  for (double lr : {1e-44, 1e-6, 3e33})
    for (CpuIsa isa : CompactSimdPaths()) {
      opt.lr = lr;
      simd.CopyFrom(ref);
      CompactBuffers r(n, 2);
      r.CopyFrom(ref);
      for (int t = 1; t <= 3; ++t) {
        opt.step = t;
        ASSERT_TRUE(CompactAdamStepOn(CpuIsa::kScalar, opt, n, r.state(), g.data(), nullptr).ok());
        ASSERT_TRUE(CompactAdamStepOn(isa, opt, n, simd.state(), g.data(), nullptr).ok());
        ASSERT_EQ(CompactDiff(r, simd), "") << CpuIsaName(isa) << " lr " << lr << " step " << t;
      }
    }
}

// The AVX2 path runs eight blocks at a time: blocks of every kind side by
// side in one group (a NaN gradient, moments all zero, an m below
// kCompactMinScale, subnormal v, a master past bf16's range, live ones), at
// every position in the group, in partial groups and with a partial block at
// the end.
TEST(CompactPaths, MixedBlocksInOneGroup) {
  constexpr size_t kKinds = 6;
  for (size_t n : {size_t{8 * kCompactBlock}, size_t{13 * kCompactBlock + 5}, size_t{27 * kCompactBlock + 31}}) {
    for (size_t shift = 0; shift < kKinds; ++shift) {
      std::vector<float> w(n), m(n), v(n), gv(n);
      Rng rng(n * 17 + shift);
      for (size_t i = 0; i < n; ++i) {
        const size_t kind = (i / kCompactBlock + shift) % kKinds;
        w[i] = rng.Spread();
        m[i] = 0.01f * rng.Spread();
        v[i] = 1e-3f * rng.Spread() * rng.Spread();
        gv[i] = rng.Spread();
        if (kind == 1 && i % kCompactBlock == 3) gv[i] = std::nanf("");
        if (kind == 2) m[i] = v[i] = gv[i] = 0.0f;
        if (kind == 3) m[i] = 1e-32f * rng.Spread(), gv[i] = 1e-33f * rng.Spread();
        if (kind == 4) v[i] = 1e-44f * (i % 3), gv[i] = 1e-22f * rng.Spread();
        if (kind == 5 && i % 7 == 0) w[i] = BitsF32(0x7f7fff80u);
      }
      Buffer g(n, 4, 0);
      for (size_t i = 0; i < n; ++i) StoreAs(DType::kF32, g.data(), i, gv[i]);
      for (CpuIsa isa : CompactSimdPaths()) {
        CompactBuffers ref(n, 0), simd(n, 3);
        ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), ref.state()).ok());
        simd.CopyFrom(ref);
        for (int t = 1; t <= 4; ++t) {
          AdamOptions opt = Options({AdamMode::kAdamW, DType::kF32, 0, 1.0f}, t);
          opt.grad_scale = 1.0;
          ASSERT_TRUE(CompactAdamStepOn(CpuIsa::kScalar, opt, n, ref.state(), g.data(), nullptr).ok());
          ASSERT_TRUE(CompactAdamStepOn(isa, opt, n, simd.state(), g.data(), nullptr).ok());
          ASSERT_EQ(CompactDiff(ref, simd), "")
              << CpuIsaName(isa) << " n " << n << " shift " << shift << " step " << t;
        }
      }
    }
  }
}

// A finite gradient whose square overflows (g = 1e21: v = 1e-3 g^2 is inf):
// fp32 updates that element by 0 and its neighbours as usual. Its block's v
// was stored as NaN, and after the next step the block's masters were NaN
// for good; now sqrt(v) saturates (compact.h): every master stays finite,
// bitwise on every path, through several steps.
TEST(CompactPaths, AnExplodedFiniteGradientKeepsItsBlockFinite) {
  const size_t n = 3 * kCompactBlock + 5;
  for (CpuIsa isa : CompactSimdPaths()) {
    CompactBuffers ref(n, 0), simd(n, 3);
    ASSERT_NO_FATAL_FAILURE(FillState(ref, n, 11));
    simd.CopyFrom(ref);
    Buffer g(n, 4, 0);
    for (int t = 1; t <= 4; ++t) {
      FillGrad(g, n, DType::kF32, 1.0f, 100 + t);
      if (t == 1) StoreAs(DType::kF32, g.data(), kCompactBlock + 7, 1e21f);
      AdamOptions opt = Options({AdamMode::kAdamW, DType::kF32, 0, 1.0f}, t);
      opt.grad_scale = 1.0;
      ASSERT_TRUE(CompactAdamStepOn(CpuIsa::kScalar, opt, n, ref.state(), g.data(), nullptr).ok());
      ASSERT_TRUE(CompactAdamStepOn(isa, opt, n, simd.state(), g.data(), nullptr).ok());
      ASSERT_EQ(CompactDiff(ref, simd), "") << CpuIsaName(isa) << " step " << t;
      std::vector<float> w(n), m(n), v(n);
      ASSERT_TRUE(CompactUnpack(n, ref.state(), w.data(), m.data(), v.data()).ok());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(w[i])) << "master " << i << " after step " << t << ": " << w[i];
        ASSERT_FALSE(std::isnan(v[i])) << "v " << i << " after step " << t;
      }
    }
  }
}

TEST(CompactPaths, ResultDoesNotDependOnThreadCount) {
  const size_t n = 5 * kElementTile + 77;  // several tiles and a partial block
  CompactBuffers base(n, 1);
  ASSERT_NO_FATAL_FAILURE(FillState(base, n, 3));
  Buffer g(n, 2, 0);
  FillGrad(g, n, DType::kBF16, 1.0f, 11);
  const Variant var{AdamMode::kAdamW, DType::kBF16, 0, 1.0f};
  std::vector<CpuIsa> paths = CompactSimdPaths();
  paths.push_back(CpuIsa::kScalar);
  for (CpuIsa isa : paths) {
    CompactBuffers one(n, 2), many(n, 3);
    one.CopyFrom(base);
    many.CopyFrom(base);
    for (int t = 1; t <= 3; ++t) {
      SetCpuKernelThreads(1);
      ASSERT_TRUE(CompactAdamStepOn(isa, Options(var, t), n, one.state(), g.data(), nullptr).ok());
      SetCpuKernelThreads(3);
      ASSERT_TRUE(CompactAdamStepOn(isa, Options(var, t), n, many.state(), g.data(), nullptr).ok());
    }
    SetCpuKernelThreads(0);
    EXPECT_EQ(CompactDiff(one, many), "") << CpuIsaName(isa);
  }
}

// Lion on every path against the scalar reference (v arrays null).
TEST(CompactPaths, LionAllVariants) {
  for (CpuIsa isa : CompactSimdPaths())
    for (DType gd : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 4; ++copy)
        for (size_t n :
             {size_t{1}, size_t{31}, size_t{33}, size_t{95}, size_t{1025}, 2 * kElementTile + 45}) {
          CompactBuffers ref(n, 1), simd(n, 4);
          ASSERT_NO_FATAL_FAILURE(FillState(ref, n, n + copy));
          simd.CopyFrom(ref);
          CompactState rs = ref.state(), ss = simd.state();
          rs.v_code = ss.v_code = nullptr;
          rs.v_scale = ss.v_scale = nullptr;
          const size_t gb = DTypeSize(gd), cb = copy ? DTypeSize(CopyDType(copy)) : 0;
          Buffer g(n, gb, 3), c_ref(n, 4, 5), c_simd(n, 4, 6);
          for (int t = 1; t <= 10; ++t) {
            FillGrad(g, n, gd, t % 2 ? 1.0f : 1e-6f, n * 31 + t);
            LionOptions opt;
            opt.lr = 1e-3 * (1.0 + 0.5 * std::sin(t));
            opt.weight_decay = 0.1;
            opt.grad_scale = 1.0 / (1024.0 + t);
            opt.grad_dtype = gd;
            opt.param_copy_dtype = CopyDType(copy);
            ASSERT_TRUE(
                CompactLionStepOn(CpuIsa::kScalar, opt, n, rs, g.data(), copy ? c_ref.data() : nullptr).ok());
            ASSERT_TRUE(CompactLionStepOn(isa, opt, n, ss, g.data(), copy ? c_simd.data() : nullptr).ok());
            const std::string where = std::string(CpuIsaName(isa)) + " grad " + DTypeName(gd) + " copy " +
                                      std::to_string(copy) + " n " + std::to_string(n) + " step " +
                                      std::to_string(t);
            ASSERT_EQ(std::memcmp(rs.w_hi, ss.w_hi, 2 * n), 0) << where;
            ASSERT_EQ(std::memcmp(rs.w_lo, ss.w_lo, n), 0) << where;
            ASSERT_EQ(std::memcmp(rs.m_code, ss.m_code, n), 0) << where;
            ASSERT_EQ(FirstDiff(rs.m_scale, ss.m_scale, CompactScaleCount(n)), -1) << where;
            if (cb) {
              ASSERT_EQ(std::memcmp(c_ref.data(), c_simd.data(), n * cb), 0) << where;
            }
          }
        }
}

TEST(CompactPaths, MissingPathIsRefusedNotRun) {
  CompactBuffers c(1, 0);
  float g = 0;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) continue;
    EXPECT_EQ(CompactAdamStepOn(isa, AdamOptions{}, 1, c.state(), &g, nullptr).code(), Code::kUnsupported);
  }
}

}  // namespace
}  // namespace strata::kernels::test

int main(int argc, char** argv) { return strata::kernels::test::RunPathTests(argc, argv); }
