// The compact state's format (kernels/cpu/compact.h) on the scalar reference:
// the master rebuild bound over every bit pattern (sampled; all 2^32 with
// STRATA_EXHAUSTIVE=1) and the binade, subnormal and overflow edges; the
// moment bounds over random and adversarial blocks; the special values; the
// step equal to Pack(AdamStep(Unpack)); and 2000 steps of compact AdamW on
// noisy problems tracking the fp32 kernel.
#include "kernels/cpu/compact.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/adam.h"
#include "kernels/cpu/lion.h"
#include "tests/kernels/compact_test_util.h"

namespace strata::kernels::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Packs w (m, v zero) and reads the master back.
std::vector<float> RoundTripMaster(const std::vector<float>& w, std::vector<uint16_t>* hi) {
  const size_t n = w.size();
  CompactBuffers c(n, 3);
  std::vector<float> zero(n, 0.0f), out(n), m(n), v(n);
  EXPECT_TRUE(CompactPack(n, w.data(), zero.data(), zero.data(), c.state()).ok());
  EXPECT_TRUE(CompactUnpack(n, c.state(), out.data(), m.data(), v.data()).ok());
  hi->assign(c.state().w_hi, c.state().w_hi + n);
  return out;
}

// Checks the W bound on w; returns the largest bit distance seen.
uint32_t CheckMaster(const std::vector<float>& w) {
  std::vector<uint16_t> hi;
  const std::vector<float> back = RoundTripMaster(w, &hi);
  uint32_t worst = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(hi[i], F32ToBF16(w[i])) << "bf16 half of " << w[i];
    if (std::isnan(w[i])) {
      EXPECT_TRUE(std::isnan(back[i])) << "NaN bits " << F32Bits(w[i]);
      continue;
    }
    const uint32_t a = F32Bits(w[i]), b = F32Bits(back[i]);
    EXPECT_EQ(a >> 31, b >> 31) << "sign of " << w[i] << " bits " << a;
    const uint32_t dist = (a & 0x7fffffffu) > (b & 0x7fffffffu) ? (a - b) : (b - a);
    // Past bf16's range (hi = ±inf) the master stays finite, within twice the bound.
    const bool over = (a & 0x7fffffffu) < 0x7f800000u && (hi[i] & 0x7fffu) == 0x7f80u;
    EXPECT_EQ(std::isfinite(back[i]), std::isfinite(w[i])) << "w " << w[i];
    EXPECT_LE(dist, over ? 2 * kCompactMasterUlps : kCompactMasterUlps)
        << "w " << w[i] << " bits " << a << " back " << back[i];
    if (dist > 2 * kCompactMasterUlps) return dist;  // one report is enough
    if (!over) worst = std::max(worst, dist);
  }
  return worst;
}

TEST(CompactMaster, BoundOverBitPatterns) {
  const uint64_t stride = Exhaustive() ? 1 : 4099;  // prime: every exponent, varied low bits
  const size_t chunk = size_t{1} << 22;
  std::vector<float> w;
  uint32_t worst = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += stride) {
    w.push_back(BitsF32(static_cast<uint32_t>(u)));
    if (w.size() == chunk) worst = std::max(worst, CheckMaster(w)), w.clear();
  }
  worst = std::max(worst, CheckMaster(w));
  std::printf("master rebuild: worst %u fp32 ULPs over the sweep\n", worst);
}

// Every fp32 value rounding to the bf16 values around the edges: zero and
// subnormals, the subnormal/normal boundary, a binade crossing at 1 (values
// just below 1 round up to it), and the top of the range, where values round
// to infinity. Every correction d in [-32768, 32768] is met, so the worst
// case (129) must be reached exactly.
TEST(CompactMaster, EdgesAndEveryCorrection) {
  std::vector<float> w;
  for (uint32_t high : {0x0000u, 0x0001u, 0x007fu, 0x0080u, 0x3f7fu, 0x3f80u, 0x7f7eu, 0x7f7fu})
    for (uint32_t sign : {0u, 0x80000000u})
      for (uint32_t low = 0; low < 0x10000u; ++low) w.push_back(BitsF32(sign | (high << 16) | low));
  for (float x :
       {0.0f, -0.0f, kInf, -kInf, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
        std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    w.push_back(x);
  EXPECT_EQ(CheckMaster(w), kCompactMasterUlps) << "the stated worst case is the real one";
}

// A rebuilt master packs back to itself (checkpoint round trips do not
// drift). Its (hi, lo) may differ: a rebuilt value exactly halfway between
// two bf16 values (lo = 127) rounds to the even one and gets lo = -127.
TEST(CompactMaster, RebuiltMasterIsAFixedPoint) {
  std::vector<float> w;
  for (uint32_t high : {0x0000u, 0x3f7fu, 0x3f80u, 0x4321u, 0x7f7fu})
    for (uint32_t sign : {0u, 0x80000000u})
      for (uint32_t low = 0; low < 0x10000u; ++low) w.push_back(BitsF32(sign | (high << 16) | low));
  std::vector<uint16_t> hi;
  const std::vector<float> once = RoundTripMaster(w, &hi);
  const std::vector<float> twice = RoundTripMaster(once, &hi);
  for (size_t i = 0; i < w.size(); ++i)
    ASSERT_EQ(F32Bits(twice[i]), F32Bits(once[i])) << "w bits " << F32Bits(w[i]);
}

TEST(CompactMaster, SpecialValuesExact) {
  const std::vector<float> w = {0.0f,
                                -0.0f,
                                kInf,
                                -kInf,
                                std::nanf(""),
                                -std::nanf(""),
                                std::numeric_limits<float>::denorm_min(),
                                std::numeric_limits<float>::max()};
  std::vector<uint16_t> hi;
  const std::vector<float> back = RoundTripMaster(w, &hi);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(F32Bits(back[i]), F32Bits(w[i])) << i;
  EXPECT_TRUE(std::isnan(back[4]) && std::isnan(back[5]));
  EXPECT_TRUE(std::isinf(BF16ToF32(hi[7])));  // P overflows like AdamStep's copy ...
  EXPECT_TRUE(std::isfinite(back[7]));        // ... the master does not
}

// One moment-bound check over blocks of m and v (n = blocks*32 + tail).
struct MomentCheck {
  double worst_m = 0, worst_v = 0;  // largest error / bound seen

  void Run(const std::vector<float>& m, const std::vector<float>& v) {
    const size_t n = m.size();
    CompactBuffers c(n, 1);
    std::vector<float> w(n, 0.0f), w2(n), m2(n), v2(n);
    ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), c.state()).ok());
    ASSERT_TRUE(CompactUnpack(n, c.state(), w2.data(), m2.data(), v2.data()).ok());
    for (size_t b = 0; b * kCompactBlock < n; ++b) {
      const size_t lo = b * kCompactBlock, hi = std::min(n, lo + kCompactBlock);
      double a = 0, r = 0;
      for (size_t i = lo; i < hi; ++i) a = std::max(a, std::fabs(double{m[i]}));
      for (size_t i = lo; i < hi; ++i) r = std::max(r, std::sqrt(double{v[i]}));
      for (size_t i = lo; i < hi; ++i) {
        const double ev = std::fabs(std::sqrt(double{v2[i]}) - std::sqrt(double{v[i]}));
        const double bv = CompactSqrtSecondBound(v[i], r);
        ASSERT_LE(ev, bv) << "v " << v[i] << " read " << v2[i] << " block max sqrt " << r;
        worst_v = std::max(worst_v, ev / bv);
        if (c.state().v_code[i] == 0) {
          ASSERT_EQ(m2[i], 0.0f) << "a zero v code must zero m";
          continue;
        }
        if (a < kCompactMinScale) {
          ASSERT_EQ(m2[i], 0.0f) << "block below kCompactMinScale";
          continue;
        }
        const double em = std::fabs(double{m2[i]} - m[i]), bm = CompactMomentBound(m[i], a);
        ASSERT_LE(em, bm) << "m " << m[i] << " read " << m2[i] << " block absmax " << a;
        worst_m = std::max(worst_m, em / bm);
      }
    }
  }
};

// Block contents: magnitudes 2^k spread over the block, heavy tails (most
// values far below the block's largest), one outlier, constants, zeros.
float Shape(Rng& rng, int shape, size_t j) {
  const float u = rng.Spread();
  switch (shape) {
    case 0:
      return u;
    case 1:
      return u * u * u * u * u * u;  // heavy tail toward 0
    case 2:
      return j == 7 ? 1e4f : u * 1e-3f;  // one outlier
    case 3:
      return 0.75f;  // constant
    case 4:
      return 0.0f;
    case 5:
      return std::ldexp(u, -static_cast<int>(rng.Next() % 40));  // 40 binades
    default:
      return u;
  }
}

TEST(CompactMoments, BoundsOverRandomAndAdversarialBlocks) {
  MomentCheck check;
  Rng rng(17);
  const size_t n = 64 * kCompactBlock + 5;  // a partial last block
  for (int shape = 0; shape < 6; ++shape)
    for (int scale_exp : {-120, -100, -90, -60, -30, -10, 0, 10, 30, 60, 100})
      for (int round = 0; round < 3; ++round) {
        std::vector<float> m(n), v(n);
        for (size_t i = 0; i < n; ++i) {
          m[i] = std::ldexp(Shape(rng, shape, i % kCompactBlock), scale_exp);
          const float s = std::ldexp(Shape(rng, (shape + round) % 6, i % kCompactBlock), scale_exp / 2);
          v[i] = round == 0 ? 1.0f : s * s;  // round 0: every v code nonzero
          if (!(std::fabs(m[i]) <= 0x1p127f)) m[i] = std::copysign(0x1p127f, m[i]);
          if (!(v[i] <= 0x1p127f)) v[i] = 0x1p127f;
        }
        ASSERT_NO_FATAL_FAILURE(check.Run(m, v)) << "shape " << shape << " 2^" << scale_exp;
      }
  // Subnormal and huge moments.
  std::vector<float> m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    m[i] = i % 2 ? std::numeric_limits<float>::denorm_min() * static_cast<float>(i)
                 : 0x1p127f / static_cast<float>(1 + i);
    v[i] = i % 3 ? std::numeric_limits<float>::denorm_min() * static_cast<float>(i)
                 : 0x1p127f / static_cast<float>(1 + i);
  }
  ASSERT_NO_FATAL_FAILURE(check.Run(m, v));
  std::printf("moments: worst error/bound m %.3f, sqrt(v) %.3f\n", check.worst_m, check.worst_v);
  EXPECT_GT(check.worst_m, 0.5) << "the M bound is far from tight: restate it";
  EXPECT_GT(check.worst_v, 0.5) << "the V bound is far from tight: restate it";
}

TEST(CompactMoments, NonFiniteBlocksReadNaNOthersUntouchedAnInfiniteVSaturates) {
  const size_t n = 3 * kCompactBlock;
  for (float bad : {kInf, -kInf, std::nanf("")}) {
    for (int which = 0; which < 3; ++which) {  // bad m, bad v, negative v
      std::vector<float> w(n, 1.0f), m(n, 0.5f), v(n, 0.25f);
      if (which == 0) m[kCompactBlock + 3] = bad;
      if (which == 1) v[kCompactBlock + 3] = std::fabs(bad);
      if (which == 2) v[kCompactBlock + 3] = -1.0f;
      CompactBuffers c(n, 0);
      std::vector<float> w2(n), m2(n), v2(n);
      ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), c.state()).ok());
      ASSERT_TRUE(CompactUnpack(n, c.state(), w2.data(), m2.data(), v2.data()).ok());
      // An infinite v (a finite gradient's square overflowed) saturates:
      // it reads back infinite, its block's others 0 (m too), none NaN.
      const bool saturated = which == 1 && std::isinf(bad);
      for (size_t i = 0; i < n; ++i) {
        const bool in_block = i / kCompactBlock == 1;
        const float got = which == 0 ? m2[i] : v2[i];
        if (saturated && in_block) {
          EXPECT_EQ(v2[i], i == kCompactBlock + 3 ? kInf : 0.0f) << "element " << i;
          EXPECT_EQ(m2[i], i == kCompactBlock + 3 ? 0.5f : 0.0f) << "element " << i;
          continue;
        }
        EXPECT_EQ(std::isnan(got), in_block && !saturated) << "element " << i << " case " << which;
        if (!in_block) {
          EXPECT_EQ(m2[i], 0.5f) << i;
        }  // constant blocks are exact
      }
    }
  }
}

// The stored scales themselves (compact.h): a live block stores its largest
// magnitude, a finite dead block 0 (and zero codes), a non-finite block NaN.
// Unpack reads zero codes as 0 whatever the scale, so only the stored bits
// (checkpoints, the bitwise contract) can tell a wrong dead scale.
TEST(CompactMoments, StoredScalesFollowTheFormat) {
  const size_t n = 4 * kCompactBlock;
  std::vector<float> w(n, 1.0f), m(n, 0.5f), v(n, 0.25f);
  for (size_t j = 0; j < kCompactBlock; ++j) m[j] = kCompactMinScale / 2;  // block 0: m dead
  m[3] = -kCompactMinScale / 4;
  for (size_t j = 0; j < kCompactBlock; ++j) v[kCompactBlock + j] = 0.0f;  // block 1: v dead
  m[2 * kCompactBlock + 5] = -3.0f;                                        // block 2: live, max 3
  v[2 * kCompactBlock + 6] = 16.0f;                                        // sqrt: max 4
  m[3 * kCompactBlock + 1] = kInf;                                         // block 3: m NaN
  CompactBuffers c(n, 0);
  ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), c.state()).ok());
  const CompactState s = c.state();
  EXPECT_EQ(F32Bits(s.m_scale[0]), 0u);
  for (size_t j = 0; j < kCompactBlock; ++j) ASSERT_EQ(s.m_code[j], 0) << j;
  EXPECT_EQ(s.v_scale[0], 0.5f);
  EXPECT_EQ(F32Bits(s.v_scale[1]), 0u);
  for (size_t j = 0; j < kCompactBlock; ++j) ASSERT_EQ(s.v_code[kCompactBlock + j], 0) << j;
  EXPECT_EQ(s.m_scale[1], 0.5f);
  EXPECT_EQ(s.m_scale[2], 3.0f);
  EXPECT_EQ(s.v_scale[2], 4.0f);
  EXPECT_TRUE(std::isnan(s.m_scale[3]));
  EXPECT_EQ(s.v_scale[3], 0.5f);
}

// The fused step is Pack(AdamStep(Unpack(state))) bit for bit on the scalar
// path, for every mode, gradient dtype, copy-out and first-moment formula
// (lerp with each weight branch: beta1 0.9 and 0.3).
TEST(CompactStep, EqualsPackOfAdamStepOfUnpack) {
  const size_t n = 40 * kCompactBlock + 13;
  struct Moment {
    MomentUpdate u;
    double beta1;
  };
  for (const Moment mo : {Moment{MomentUpdate::kMulAdd, 0.9}, Moment{MomentUpdate::kLerp, 0.9},
                          Moment{MomentUpdate::kLerp, 0.3}})
  for (AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam})
    for (DType gd : {DType::kF32, DType::kBF16, DType::kF16})
      for (int copy = 0; copy < 4; ++copy) {
        const DType cd = copy == 1 ? DType::kBF16 : copy == 2 ? DType::kF16 : DType::kF32;
        Rng rng(n + copy);
        std::vector<float> w(n), m(n), v(n);
        for (size_t i = 0; i < n; ++i)
          w[i] = rng.Spread(), m[i] = 0.1f * rng.Spread(), v[i] = 0.01f * std::fabs(rng.Spread());
        CompactBuffers c(n, 2), ref(n, 7);
        ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), c.state()).ok());
        std::vector<uint8_t> g(n * 4), copy_c(n * 4), copy_r(n * 4);
        for (int t = 1; t <= 5; ++t) {
          for (size_t i = 0; i < n; ++i) StoreAs(gd, g.data(), i, rng.Spread());
          AdamOptions opt;
          opt.mode = mode, opt.lr = 1e-2, opt.weight_decay = 0.1, opt.step = t;
          opt.grad_dtype = gd, opt.param_copy_dtype = cd, opt.grad_scale = 0.5;
          opt.moment_update = mo.u, opt.beta1 = mo.beta1;
          ASSERT_TRUE(CompactUnpack(n, c.state(), w.data(), m.data(), v.data()).ok());
          AdamOptions ropt = opt;
          ropt.param_copy_dtype = cd == DType::kF32 ? DType::kBF16 : cd;
          ASSERT_TRUE(AdamStepOn(CpuIsa::kScalar, ropt, n, w.data(), m.data(), v.data(), g.data(),
                                 copy == 1 || copy == 2 ? copy_r.data() : nullptr)
                          .ok());
          if (copy == 3) std::memcpy(copy_r.data(), w.data(), 4 * n);
          ASSERT_TRUE(CompactPack(n, w.data(), m.data(), v.data(), ref.state()).ok());
          ASSERT_TRUE(
              CompactAdamStepOn(CpuIsa::kScalar, opt, n, c.state(), g.data(), copy ? copy_c.data() : nullptr)
                  .ok());
          ASSERT_EQ(CompactDiff(c, ref), "")
              << "mode " << int(mode) << " grad " << DTypeName(gd) << " copy " << copy << " step " << t << " "
              << MomentUpdateName(mo.u) << " beta1 " << mo.beta1;
          if (copy) {
            ASSERT_EQ(std::memcmp(copy_c.data(), copy_r.data(), n * DTypeSize(cd)), 0) << copy;
          }
        }
      }
}

// Lion's state has no v: the step is Pack(LionStep(Unpack)) with v null.
TEST(CompactStep, LionEqualsPackOfLionStepOfUnpack) {
  const size_t n = 40 * kCompactBlock + 13;
  for (DType gd : {DType::kF32, DType::kBF16, DType::kF16})
    for (int copy = 0; copy < 4; ++copy) {
      const DType cd = copy == 1 ? DType::kBF16 : copy == 2 ? DType::kF16 : DType::kF32;
      Rng rng(n + copy);
      std::vector<float> w(n), m(n);
      for (size_t i = 0; i < n; ++i) w[i] = rng.Spread(), m[i] = i % 7 ? 0.1f * rng.Spread() : 0.0f;
      CompactBuffers c(n, 2), ref(n, 7);
      CompactState cs = c.state(), rs = ref.state();
      cs.v_code = rs.v_code = nullptr;
      cs.v_scale = rs.v_scale = nullptr;
      ASSERT_TRUE(CompactPack(n, w.data(), m.data(), nullptr, cs).ok());
      std::vector<uint8_t> g(n * 4), copy_c(n * 4), copy_r(n * 4);
      for (int t = 1; t <= 5; ++t) {
        for (size_t i = 0; i < n; ++i) StoreAs(gd, g.data(), i, rng.Spread());
        LionOptions opt;
        opt.lr = 1e-2, opt.weight_decay = 0.1, opt.grad_dtype = gd, opt.param_copy_dtype = cd;
        opt.grad_scale = 0.5;
        ASSERT_TRUE(CompactUnpack(n, cs, w.data(), m.data(), nullptr).ok());
        LionOptions ropt = opt;
        ropt.param_copy_dtype = cd == DType::kF32 ? DType::kBF16 : cd;
        ASSERT_TRUE(LionStepOn(CpuIsa::kScalar, ropt, n, w.data(), m.data(), g.data(),
                               copy == 1 || copy == 2 ? copy_r.data() : nullptr)
                        .ok());
        if (copy == 3) std::memcpy(copy_r.data(), w.data(), 4 * n);
        ASSERT_TRUE(CompactPack(n, w.data(), m.data(), nullptr, rs).ok());
        ASSERT_TRUE(
            CompactLionStepOn(CpuIsa::kScalar, opt, n, c.state(), g.data(), copy ? copy_c.data() : nullptr)
                .ok());
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(cs.w_hi[i], rs.w_hi[i]) << i;
          ASSERT_EQ(cs.w_lo[i], rs.w_lo[i]) << i;
          ASSERT_EQ(cs.m_code[i], rs.m_code[i]) << i;
        }
        ASSERT_EQ(FirstDiff(cs.m_scale, rs.m_scale, CompactScaleCount(n)), -1);
        if (copy) {
          ASSERT_EQ(std::memcmp(copy_c.data(), copy_r.data(), n * DTypeSize(cd)), 0) << copy;
        }
      }
    }
}

// 2000 steps of AdamW on a noisy problem from the same start, fp32 state
// against compact state; each run computes its gradients at its own params,
// with the same noise. Returns the largest relative loss gap after step 100
// and prints the curves every 250 steps.
template <typename Grad, typename Loss>
double TrackFp32(const char* name, size_t n, const std::vector<float>& w0, Grad grad, Loss loss) {
  std::vector<float> w = w0, m(n, 0.0f), v(n, 0.0f), gw(n), gc(n), wc(n), mc(n), vc(n);
  CompactBuffers c(n, 0);
  EXPECT_TRUE(CompactPack(n, w0.data(), m.data(), v.data(), c.state()).ok());
  double worst = 0;
  for (int t = 1; t <= 2000; ++t) {
    EXPECT_TRUE(CompactUnpack(n, c.state(), wc.data(), mc.data(), vc.data()).ok());
    grad(t, w, &gw);
    grad(t, wc, &gc);
    AdamOptions opt;
    opt.lr = 1e-2 * (t < 1000 ? 1.0 : 0.1);
    opt.weight_decay = 0.01;
    opt.step = t;
    EXPECT_TRUE(AdamStep(opt, n, w.data(), m.data(), v.data(), gw.data(), nullptr).ok());
    EXPECT_TRUE(CompactAdamStep(opt, n, c.state(), gc.data(), nullptr).ok());
    if (t % 10 != 0) continue;
    const double lf = loss(w), lc = loss(wc);
    if (t > 100) worst = std::max(worst, std::fabs(lc - lf) / lf);
    if (t % 250 == 0) std::printf("%s step %4d loss fp32 %.6g compact %.6g\n", name, t, lf, lc);
  }
  return worst;
}

TEST(CompactQuality, NoisyQuadraticTracksFp32) {
  const size_t n = 4096;
  Rng rng(5);
  std::vector<float> h(n), target(n), w0(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = std::ldexp(1.0f, -static_cast<int>(rng.Next() % 8));  // curvatures over 8 binades
    target[i] = rng.Spread();
    w0[i] = rng.Spread();
  }
  auto grad = [&](int t, const std::vector<float>& w, std::vector<float>* g) {
    Rng noise(1000 + t);
    for (size_t i = 0; i < n; ++i) (*g)[i] = h[i] * (w[i] - target[i]) + 0.1f * noise.Spread();
  };
  auto loss = [&](const std::vector<float>& w) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += 0.5 * h[i] * (w[i] - target[i]) * (w[i] - target[i]);
    return s / n;
  };
  const double gap = TrackFp32("quadratic", n, w0, grad, loss);
  std::printf("quadratic: largest relative loss gap after step 100: %.4f\n", gap);
  EXPECT_LT(gap, 0.05);  // measured 0.0345 (noise 0.1*Spread: the curves cross)
}

TEST(CompactQuality, LogisticRegressionTracksFp32) {
  const size_t d = 512, samples = 2048, batch = 64;
  Rng rng(9);
  std::vector<float> x(samples * d), y(samples), teacher(d), w0(d, 0.0f);
  for (size_t j = 0; j < d; ++j) teacher[j] = rng.Spread();
  for (size_t s = 0; s < samples; ++s) {
    double z = 0;
    for (size_t j = 0; j < d; ++j) z += (x[s * d + j] = rng.Spread() / 16) * teacher[j];
    y[s] = (z + 0.5 * rng.Spread() > 0) ? 1.0f : 0.0f;  // noisy labels
  }
  auto logit = [&](const std::vector<float>& w, size_t s) {
    double z = 0;
    for (size_t j = 0; j < d; ++j) z += double{x[s * d + j]} * w[j];
    return z;
  };
  auto grad = [&](int t, const std::vector<float>& w, std::vector<float>* g) {
    std::fill(g->begin(), g->end(), 0.0f);
    for (size_t k = 0; k < batch; ++k) {
      const size_t s = (static_cast<size_t>(t) * batch + k) % samples;
      const float err = static_cast<float>(1.0 / (1.0 + std::exp(-logit(w, s)))) - y[s];
      for (size_t j = 0; j < d; ++j) (*g)[j] += err * x[s * d + j] / batch;
    }
  };
  auto loss = [&](const std::vector<float>& w) {
    double l = 0;
    for (size_t s = 0; s < samples; ++s) {
      const double z = logit(w, s);
      l += std::log1p(std::exp(-std::fabs(z))) + std::max(z, 0.0) - y[s] * z;
    }
    return l / samples;
  };
  const double gap = TrackFp32("logistic", d, w0, grad, loss);
  std::printf("logistic: largest relative loss gap after step 100: %.4f\n", gap);
  EXPECT_LT(gap, 0.02);  // measured 0.0078
}

// Lion keeps its quality too: 2000 steps on the noisy quadratic.
TEST(CompactQuality, LionNoisyQuadraticTracksFp32) {
  const size_t n = 4096;
  Rng rng(6);
  std::vector<float> h(n), target(n), w(n), m(n, 0.0f), g(n), wc(n), mc(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = std::ldexp(1.0f, -static_cast<int>(rng.Next() % 8));
    target[i] = rng.Spread();
    w[i] = rng.Spread();
  }
  CompactBuffers c(n, 0);
  CompactState cs = c.state();
  cs.v_code = nullptr;
  cs.v_scale = nullptr;
  ASSERT_TRUE(CompactPack(n, w.data(), m.data(), nullptr, cs).ok());
  auto loss = [&](const std::vector<float>& x) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += 0.5 * h[i] * (x[i] - target[i]) * (x[i] - target[i]);
    return s / n;
  };
  double worst = 0;
  for (int t = 1; t <= 2000; ++t) {
    ASSERT_TRUE(CompactUnpack(n, cs, wc.data(), mc.data(), nullptr).ok());
    LionOptions opt;
    opt.lr = t < 1000 ? 1e-2 : 1e-3;
    opt.weight_decay = 0.01;
    for (int k = 0; k < 2; ++k) {
      const std::vector<float>& x = k ? wc : w;
      Rng noise(2000 + t);
      for (size_t i = 0; i < n; ++i) g[i] = h[i] * (x[i] - target[i]) + 0.1f * noise.Spread();
      if (k == 0) {
        ASSERT_TRUE(LionStep(opt, n, w.data(), m.data(), g.data(), nullptr).ok());
      }
      if (k == 1) {
        ASSERT_TRUE(CompactLionStep(opt, n, cs, g.data(), nullptr).ok());
      }
    }
    if (t % 10 != 0) continue;
    const double lf = loss(w), lc = loss(wc);
    if (t > 100) worst = std::max(worst, std::fabs(lc - lf) / lf);
    if (t % 500 == 0) std::printf("lion step %4d loss fp32 %.6g compact %.6g\n", t, lf, lc);
  }
  std::printf("lion quadratic: largest relative loss gap after step 100: %.4f\n", worst);
  EXPECT_LT(worst, 0.12);  // measured 0.091 (at lr 1e-3: 0.004); Lion follows m's sign alone
}

TEST(CompactOptions, BadInputIsRefused) {
  CompactBuffers c(1, 0);
  float g = 0, w = 0;
  AdamOptions opt;
  opt.step = 0;
  EXPECT_EQ(CompactAdamStep(opt, 1, c.state(), &g, nullptr).code(), Code::kInvalid);
  opt.step = 1;
  EXPECT_EQ(CompactAdamStep(opt, 1, c.state(), nullptr, nullptr).code(), Code::kInvalid);
  CompactState broken = c.state();
  broken.v_scale = nullptr;
  EXPECT_EQ(CompactAdamStep(opt, 1, broken, &g, nullptr).code(), Code::kInvalid);
  EXPECT_EQ(CompactPack(1, &w, &w, &w, broken).code(), Code::kInvalid);
  EXPECT_EQ(CompactPack(1, &w, &w, nullptr, c.state()).code(), Code::kInvalid);  // v arrays but no v
  LionOptions lion;
  EXPECT_TRUE(CompactLionStep(lion, 1, broken, &g, nullptr).ok());  // Lion reads no v
  opt.param_copy_dtype = DType::kF32;                               // allowed here: the fp32 master
  EXPECT_TRUE(CompactAdamStep(opt, 1, c.state(), &g, &w).ok());
}

}  // namespace
}  // namespace strata::kernels::test
