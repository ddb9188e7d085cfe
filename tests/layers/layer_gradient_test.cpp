// Every CPU layer's backward against finite differences of its forward.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cpu/layers/attention.h"
#include "kernels/cpu/layers/cross_entropy.h"
#include "kernels/cpu/layers/elementwise.h"
#include "kernels/cpu/layers/encoder.h"
#include "kernels/cpu/layers/layernorm.h"
#include "kernels/cpu/layers/matmul.h"
#include "tests/layers/layer_test_util.h"

namespace strata::layers::test {
namespace {

using Vec = std::vector<float>;

Vec Zeros(size_t n) { return Vec(n, 0.0f); }

TEST(LayerGradient, Matmul) {
  const size_t N = 6, C = 5, OC = 7;
  Vec inp = Random(N * C, 1), w = Random(OC * C, 2), b = Random(OC, 3), r = Random(N * OC, 4);
  Vec out(N * OC);
  auto loss = [&] {
    MatmulForward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
    return Dot(r, out.data());
  };
  Vec dinp = Zeros(N * C), dw = Zeros(OC * C), db = Zeros(OC);
  MatmulBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), N, C, OC);
  CheckGradient("matmul.dinp", inp, dinp.data(), loss, 1e-3, 1e-3);
  CheckGradient("matmul.dweight", w, dw.data(), loss, 1e-3, 1e-3);
  CheckGradient("matmul.dbias", b, db.data(), loss, 1e-3, 1e-3);
}

TEST(LayerGradient, MatmulWithoutBiasAccumulates) {
  const size_t N = 3, C = 4, OC = 2;
  Vec inp = Random(N * C, 5), w = Random(OC * C, 6), r = Random(N * OC, 7);
  Vec out(N * OC), expect(N * OC);
  MatmulForward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
  for (size_t n = 0; n < N; ++n)
    for (size_t o = 0; o < OC; ++o) {
      double s = 0;
      for (size_t c = 0; c < C; ++c) s += static_cast<double>(inp[n * C + c]) * w[o * C + c];
      EXPECT_NEAR(out[n * OC + o], s, 1e-6);
    }
  // Backward adds to what is there: twice from zero equals 2x once.
  Vec dw1 = Zeros(OC * C), dw2 = Zeros(OC * C);
  MatmulBackward(nullptr, dw1.data(), nullptr, r.data(), inp.data(), w.data(), N, C, OC);
  MatmulBackward(nullptr, dw2.data(), nullptr, r.data(), inp.data(), w.data(), N, C, OC);
  MatmulBackward(nullptr, dw2.data(), nullptr, r.data(), inp.data(), w.data(), N, C, OC);
  for (size_t i = 0; i < dw1.size(); ++i) EXPECT_FLOAT_EQ(dw2[i], 2 * dw1[i]);
}

TEST(LayerGradient, LayerNorm) {
  const size_t N = 5, C = 16;
  Vec inp = Random(N * C, 11, -2, 2), w = Random(C, 12, 0.5f, 1.5f), b = Random(C, 13), r = Random(N * C, 14);
  Vec out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
    return Dot(r, out.data());
  };
  loss();
  Vec dinp = Zeros(N * C), dw = Zeros(C), db = Zeros(C);
  LayerNormBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), mean.data(),
                    rstd.data(), N, C);
  CheckGradient("layernorm.dinp", inp, dinp.data(), loss, 2e-3, 2e-3);
  CheckGradient("layernorm.dweight", w, dw.data(), loss, 1e-3, 1e-3);
  CheckGradient("layernorm.dbias", b, db.data(), loss, 1e-3, 1e-3);
}

TEST(LayerGradient, Encoder) {
  const size_t B = 2, T = 3, C = 4, V = 5, maxT = 4;
  const std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3};  // repeats: the scatter must add up
  Vec wte = Random(V * C, 21), wpe = Random(maxT * C, 22), r = Random(B * T * C, 23);
  Vec out(B * T * C);
  auto loss = [&] {
    EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
    return Dot(r, out.data());
  };
  Vec dwte = Zeros(V * C), dwpe = Zeros(maxT * C);
  EncoderBackward(dwte.data(), dwpe.data(), r.data(), tokens.data(), B, T, C);
  CheckGradient("encoder.dwte", wte, dwte.data(), loss, 1e-4, 1e-4);
  CheckGradient("encoder.dwpe", wpe, dwpe.data(), loss, 1e-4, 1e-4);
}

TEST(LayerGradient, Attention) {
  const size_t B = 2, T = 5, C = 8, NH = 2;
  Vec qkv = Random(B * T * 3 * C, 31, -1.5f, 1.5f), r = Random(B * T * C, 32);
  Vec out(B * T * C), att(B * NH * T * T);
  auto loss = [&] {
    AttentionForward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return Dot(r, out.data());
  };
  loss();
  // Causal: probabilities after the diagonal are zero, each row sums to one.
  for (size_t row = 0; row < B * NH * T; ++row) {
    const size_t t = row % T;
    double sum = 0;
    for (size_t t2 = 0; t2 < T; ++t2) {
      if (t2 > t) {
        EXPECT_EQ(att[row * T + t2], 0.0f);
      }
      sum += att[row * T + t2];
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
  Vec dqkv = Zeros(qkv.size());
  AttentionBackward(dqkv.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  CheckGradient("attention.dqkv", qkv, dqkv.data(), loss, 1e-3, 2e-3);
}

TEST(LayerGradient, Gelu) {
  const size_t n = 64;
  Vec x = Random(n, 41, -4, 4), r = Random(n, 42), y(n);
  auto loss = [&] {
    GeluForward(y.data(), x.data(), n);
    return Dot(r, y.data());
  };
  loss();
  EXPECT_NEAR(
      y[0], 0.5 * x[0] * (1 + std::tanh(std::sqrt(2 / M_PI) * (x[0] + 0.044715 * x[0] * x[0] * x[0]))), 1e-6);
  Vec dx = Zeros(n);
  GeluBackward(dx.data(), x.data(), r.data(), n);
  CheckGradient("gelu.dinp", x, dx.data(), loss, 1e-4, 1e-3);
}

TEST(LayerGradient, Residual) {
  const size_t n = 32;
  Vec a = Random(n, 51), b = Random(n, 52), r = Random(n, 53), y(n);
  auto loss = [&] {
    ResidualForward(y.data(), a.data(), b.data(), n);
    return Dot(r, y.data());
  };
  Vec da = Zeros(n), db = Zeros(n);
  ResidualBackward(da.data(), db.data(), r.data(), n);
  CheckGradient("residual.da", a, da.data(), loss, 1e-5, 1e-4);
  CheckGradient("residual.db", b, db.data(), loss, 1e-5, 1e-4);
}

TEST(LayerGradient, CrossEntropy) {
  const size_t N = 4, V = 9;
  Vec logits = Random(N * V, 61, -3, 3);
  const std::vector<int32_t> targets = {0, 8, 3, 3};
  const float dloss = 1.0f / N;
  Vec losses(N), dlogits(N * V);
  auto loss = [&] {
    CrossEntropyForwardBackward(losses.data(), nullptr, logits.data(), targets.data(), N, V, dloss);
    double s = 0;
    for (float l : losses) s += l;
    return s / N;
  };
  CrossEntropyForwardBackward(losses.data(), dlogits.data(), logits.data(), targets.data(), N, V, dloss);
  // Against a fp64 log-softmax.
  for (size_t r = 0; r < N; ++r) {
    double sum = 0;
    for (size_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[r * V + i]));
    EXPECT_NEAR(losses[r], std::log(sum) - logits[r * V + targets[r]], 2e-6);
  }
  CheckGradient("cross_entropy.dlogits", logits, dlogits.data(), loss, 1e-4, 1e-3);
  // In place: dlogits may overwrite logits.
  Vec inplace = logits;
  CrossEntropyForwardBackward(losses.data(), inplace.data(), inplace.data(), targets.data(), N, V, dloss);
  EXPECT_EQ(0, std::memcmp(inplace.data(), dlogits.data(), inplace.size() * sizeof(float)));
}

}  // namespace
}  // namespace strata::layers::test
