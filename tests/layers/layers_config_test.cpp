// GptConfig validation, the groups' layouts, and the dtype conversions.
#include <gtest/gtest.h>

#include "base/dtype.h"
#include "kernels/cpu/layers/convert.h"
#include "kernels/cpu/layers/gpt_config.h"
#include "tests/layers/layer_test_util.h"

namespace strata::layers::test {
namespace {

TEST(GptConfigTest, Validates) {
  EXPECT_TRUE(ValidateGptConfig({50257, 1024, 768, 12, 12}).ok());
  const Status heads = ValidateGptConfig({100, 16, 10, 3, 1});
  EXPECT_FALSE(heads.ok());
  EXPECT_NE(heads.message().find("heads"), std::string::npos) << heads.message();
  const Status layers = ValidateGptConfig({100, 16, 8, 2, 0});
  EXPECT_NE(layers.message().find("layers"), std::string::npos) << layers.message();
}

TEST(GptConfigTest, BlockLayoutIsTheConcatenationInOrder) {
  const GptConfig cfg{50257, 1024, 768, 12, 12};
  const auto t = BlockParamTensors(cfg);
  const char* names[] = {"ln1.weight",       "ln1.bias",       "attn.qkv.weight", "attn.qkv.bias",
                         "attn.proj.weight", "attn.proj.bias", "ln2.weight",      "ln2.bias",
                         "mlp.fc.weight",    "mlp.fc.bias",    "mlp.proj.weight", "mlp.proj.bias"};
  size_t offset = 0;
  for (int i = 0; i < kBlockTensorCount; ++i) {
    EXPECT_STREQ(t[i].name, names[i]);
    EXPECT_EQ(t[i].offset, offset);
    EXPECT_EQ(t[i].count, t[i].rows * t[i].cols);
    offset += t[i].count;
  }
  EXPECT_EQ(offset, BlockParamCount(cfg));
  EXPECT_EQ(t[kQkvWeight].rows, 3u * 768);
  EXPECT_EQ(t[kFcProjWeight].cols, 4u * 768);
  // GPT-2 small: 124,439,808 parameters with the tied head (llm.c's count, unpadded vocab).
  EXPECT_EQ(GptParamCount(cfg), 124439808u);
}

TEST(GptConfigTest, EmbedLayout) {
  const GptConfig cfg{11, 8, 4, 2, 1};
  const auto t = EmbedParamTensors(cfg);
  EXPECT_STREQ(t[kWte].name, "wte");
  EXPECT_EQ(t[kWpe].offset, 44u);
  EXPECT_STREQ(t[kLnfBias].name, "lnf.bias");
  EXPECT_EQ(t[kLnfBias].offset + t[kLnfBias].count, EmbedParamCount(cfg));
}

TEST(ConvertTest, MatchesTheScalarConversions) {
  const size_t n = 40000;  // more than one tile
  std::vector<float> x = Random(n, 3, -100, 100);
  x[0] = 1.0f + 1.0f / 256;  // a tie: rounds to even
  std::vector<uint16_t> h(n);
  std::vector<float> back(n);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    FromF32(dt, x.data(), h.data(), n);
    ToF32(dt, h.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t want = dt == DType::kBF16 ? F32ToBF16(x[i]) : F32ToF16(x[i]);
      ASSERT_EQ(h[i], want) << DTypeName(dt) << " " << i;
      ASSERT_EQ(back[i], dt == DType::kBF16 ? BF16ToF32(want) : F16ToF32(want));
    }
  }
  std::vector<float> copy(n);
  ToF32(DType::kF32, x.data(), copy.data(), n);
  EXPECT_EQ(copy, x);
}

}  // namespace
}  // namespace strata::layers::test
