// A whole block's and the head's backward against finite differences, the
// block's two backward modes against each other, and the aliasing it allows.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/head.h"
#include "tests/layers/layer_test_util.h"

namespace strata::layers::test {
namespace {

using Vec = std::vector<float>;

constexpr GptConfig kCfg{13, 8, 8, 2, 1};  // V, maxT, C, NH, L
constexpr size_t kB = 2, kT = 5;

// Plausible block parameters: LayerNorm weights near 1, the rest small.
Vec BlockParams(uint64_t seed) {
  Vec p = Random(BlockParamCount(kCfg), seed, -0.5f, 0.5f);
  const auto t = BlockParamTensors(kCfg);
  for (int i : {kLn1Weight, kLn2Weight}) {
    for (size_t j = 0; j < t[i].count; ++j) p[t[i].offset + j] += 1.0f;
  }
  return p;
}

bool SameBits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(BlockGradient, FiniteDifferences) {
  const size_t NC = kB * kT * kCfg.channels;
  Vec params = BlockParams(1), x = Random(NC, 2, -2, 2), r = Random(NC, 3), y(NC);
  BlockActs acts;
  BlockActsInit(&acts, kCfg, kB, kT);
  auto loss = [&] {
    BlockForward(kCfg, params.data(), x.data(), y.data(), &acts, kB, kT);
    return Dot(r, y.data());
  };
  Vec dparams(params.size(), 0.0f), dx(NC);
  BlockBackward(kCfg, params.data(), x.data(), r.data(), &acts, BlockBackwardMode::kRecompute, dparams.data(),
                dx.data(), kB, kT);
  CheckGradient("block.dx_in", x, dx.data(), loss, 2e-3, 2e-3);
  CheckGradient("block.dparams", params, dparams.data(), loss, 2e-3, 2e-3);
}

TEST(BlockGradient, SavedAndRecomputedModesAgreeBitwise) {
  const size_t NC = kB * kT * kCfg.channels;
  const Vec params = BlockParams(4), x = Random(NC, 5, -2, 2), dy = Random(NC, 6);
  BlockActs acts;
  BlockActsInit(&acts, kCfg, kB, kT);
  Vec y(NC), g_saved(params.size(), 0.0f), dx_saved(NC);
  BlockForward(kCfg, params.data(), x.data(), y.data(), &acts, kB, kT);
  BlockBackward(kCfg, params.data(), x.data(), dy.data(), &acts, BlockBackwardMode::kSaved, g_saved.data(),
                dx_saved.data(), kB, kT);
  BlockActs fresh;  // recompute needs nothing from a forward
  BlockActsInit(&fresh, kCfg, kB, kT);
  Vec g_re(params.size(), 0.0f), dx_re(NC);
  BlockBackward(kCfg, params.data(), x.data(), dy.data(), &fresh, BlockBackwardMode::kRecompute, g_re.data(),
                dx_re.data(), kB, kT);
  EXPECT_TRUE(SameBits(g_saved, g_re));
  EXPECT_TRUE(SameBits(dx_saved, dx_re));
  // dparams accumulates; dx_in may be dx_out's buffer; x_out may be x_in's.
  Vec inout = dy;
  BlockBackward(kCfg, params.data(), x.data(), inout.data(), &fresh, BlockBackwardMode::kRecompute,
                g_re.data(), inout.data(), kB, kT);
  EXPECT_TRUE(SameBits(inout, dx_saved));
  // (Not bitwise 2x: the second backward adds its terms one by one to the first's sum.)
  for (size_t i = 0; i < g_re.size(); ++i) ASSERT_NEAR(g_re[i], 2 * g_saved[i], 1e-5) << i;
  Vec xy = x;
  BlockForward(kCfg, params.data(), xy.data(), xy.data(), &fresh, kB, kT);
  EXPECT_TRUE(SameBits(xy, y));
}

TEST(HeadGradient, FiniteDifferences) {
  const size_t N = kB * kT, NC = N * kCfg.channels;
  Vec embed = Random(EmbedParamCount(kCfg), 7), x = Random(NC, 8, -2, 2);
  const auto t = EmbedParamTensors(kCfg);
  for (size_t j = 0; j < t[kLnfWeight].count; ++j) embed[t[kLnfWeight].offset + j] += 1.0f;
  const std::vector<int32_t> targets = RandomTokens(N, kCfg.vocab, 9);
  HeadActs acts;
  HeadActsInit(&acts, kCfg, kB, kT);
  auto loss = [&] {  // the mean in fp64 from the per-token losses, not the rounded return value
    HeadForwardBackward(kCfg, embed.data(), x.data(), targets.data(), kB, kT, &acts, nullptr, nullptr);
    double s = 0;
    for (size_t r = 0; r < N; ++r) s += acts.losses[r];
    return s / N;
  };
  Vec dembed(embed.size(), 0.0f), dx(NC);
  const float mean = HeadForwardBackward(kCfg, embed.data(), x.data(), targets.data(), kB, kT, &acts,
                                         dx.data(), dembed.data());
  EXPECT_FLOAT_EQ(mean, static_cast<float>(loss()));
  for (size_t j = t[kWpe].offset; j < t[kWpe].offset + t[kWpe].count; ++j) ASSERT_EQ(dembed[j], 0.0f);
  CheckGradient("head.dx", x, dx.data(), loss, 1e-4, 2e-3);
  CheckGradient("head.dembed", embed, dembed.data(), loss, 1e-4, 2e-3);
}

}  // namespace
}  // namespace strata::layers::test
