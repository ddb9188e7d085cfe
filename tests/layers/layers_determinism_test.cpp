// Determinism: the model's forward and backward give bitwise the same loss and
// gradients run after run and with 1 or 2 oneTBB threads. Sizes make several
// tiles of every kernel (128 rows of 64 channels, two head chunks).
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <cstring>

#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/encoder.h"
#include "kernels/cpu/layers/head.h"
#include "tests/layers/layer_test_util.h"

namespace strata::layers::test {
namespace {

using Vec = std::vector<float>;

constexpr GptConfig kCfg{97, 64, 64, 4, 2};  // V, maxT, C, NH, L
constexpr size_t kB = 2, kT = 64;

// Loss bits, then the embedding and block gradients, in one vector.
Vec RunModel() {
  const size_t C = kCfg.channels, L = kCfg.layers, NC = kB * kT * C;
  Vec embed = Random(EmbedParamCount(kCfg), 1, -0.3f, 0.3f);
  std::vector<Vec> blocks;
  for (size_t l = 0; l < L; ++l) blocks.push_back(Random(BlockParamCount(kCfg), 10 + l, -0.2f, 0.2f));
  const auto tokens = RandomTokens(kB * kT, kCfg.vocab, 2), targets = RandomTokens(kB * kT, kCfg.vocab, 3);
  const auto et = EmbedParamTensors(kCfg);
  std::vector<Vec> xs(L + 1, Vec(NC));
  EncoderForward(xs[0].data(), tokens.data(), embed.data() + et[kWte].offset, embed.data() + et[kWpe].offset,
                 kB, kT, C, kCfg.vocab);
  BlockActs acts;
  BlockActsInit(&acts, kCfg, kB, kT);
  for (size_t l = 0; l < L; ++l)
    BlockForward(kCfg, blocks[l].data(), xs[l].data(), xs[l + 1].data(), &acts, kB, kT);
  HeadActs head;
  HeadActsInit(&head, kCfg, kB, kT);
  Vec dembed(embed.size(), 0.0f), dx(NC);
  const float loss = HeadForwardBackward(kCfg, embed.data(), xs[L].data(), targets.data(), kB, kT, &head,
                                         dx.data(), dembed.data());
  Vec out = {loss};
  for (size_t l = L; l-- > 0;) {
    Vec g(blocks[l].size(), 0.0f);
    BlockBackward(kCfg, blocks[l].data(), xs[l].data(), dx.data(), &acts, BlockBackwardMode::kRecompute,
                  g.data(), dx.data(), kB, kT);
    out.insert(out.end(), g.begin(), g.end());
  }
  EncoderBackward(dembed.data() + et[kWte].offset, dembed.data() + et[kWpe].offset, dx.data(), tokens.data(),
                  kB, kT, C);
  out.insert(out.end(), dembed.begin(), dembed.end());
  return out;
}

Vec RunWithThreads(int threads) {
  tbb::task_arena arena(threads);
  Vec out;
  arena.execute([&] { out = RunModel(); });
  return out;
}

void ExpectSameBits(const Vec& a, const Vec& b) {
  ASSERT_EQ(a.size(), b.size());
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u) << "of " << a.size() << " values";
}

TEST(LayersDeterminism, SameResultTwice) {
  const Vec first = RunModel();
  EXPECT_TRUE(std::isfinite(first[0]));
  ExpectSameBits(first, RunModel());
}

TEST(LayersDeterminism, SameResultWithOneOrTwoThreads) {
  const Vec one = RunWithThreads(1);
  ExpectSameBits(one, RunWithThreads(2));
  ExpectSameBits(one, RunWithThreads(4));  // more threads than CPUs here: still the same tiles
}

}  // namespace
}  // namespace strata::layers::test
