// The whole tiny model (embeddings → L blocks → lnf → tied head → mean loss),
// forward and backward through the layer kernels, against a plain-loop fp64
// reference written here without BLAS; the reference's own backward is checked
// by fp64 finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/layers/block.h"
#include "kernels/cpu/layers/encoder.h"
#include "kernels/cpu/layers/head.h"
#include "tests/layers/layer_test_util.h"

namespace strata::layers::test {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

// B·T = 72 > kHeadChunkRows: the head runs two chunks.
constexpr GptConfig kCfg{13, 32, 8, 2, 2};  // V, maxT, C, NH, L
constexpr size_t kB = 3, kT = 24;

// ---- fp64 reference: naive loops over (rows, channels) ----------------------

// y (N, OC) = x (N, C) · W (OC, C)ᵀ + b
void RefLinear(DVec& y, const DVec& x, const double* w, const double* b, size_t N, size_t C, size_t OC) {
  y.assign(N * OC, 0.0);
  for (size_t n = 0; n < N; ++n)
    for (size_t o = 0; o < OC; ++o) {
      double s = b ? b[o] : 0.0;
      for (size_t c = 0; c < C; ++c) s += x[n * C + c] * w[o * C + c];
      y[n * OC + o] = s;
    }
}
void RefLinearBack(DVec& dx, double* dw, double* db, const DVec& dy, const DVec& x, const double* w, size_t N,
                   size_t C, size_t OC) {
  dx.assign(N * C, 0.0);
  for (size_t n = 0; n < N; ++n)
    for (size_t o = 0; o < OC; ++o) {
      const double g = dy[n * OC + o];
      if (db) db[o] += g;
      for (size_t c = 0; c < C; ++c) {
        dx[n * C + c] += g * w[o * C + c];
        dw[o * C + c] += g * x[n * C + c];
      }
    }
}

void RefLayerNorm(DVec& y, const DVec& x, const double* w, const double* b, size_t N, size_t C) {
  y.assign(N * C, 0.0);
  for (size_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (size_t c = 0; c < C; ++c) m += x[n * C + c] / C;
    for (size_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    for (size_t c = 0; c < C; ++c) y[n * C + c] = (x[n * C + c] - m) / std::sqrt(v + 1e-5) * w[c] + b[c];
  }
}
// Backward by the chain rule written out per row: dx_i = rstd·(dn_i - mean(dn) - n_i·mean(dn·n)).
void RefLayerNormBack(DVec& dx, double* dw, double* db, const DVec& dy, const DVec& x, const double* w,
                      size_t N, size_t C) {
  dx.assign(N * C, 0.0);
  for (size_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (size_t c = 0; c < C; ++c) m += x[n * C + c] / C;
    for (size_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    const double rs = 1 / std::sqrt(v + 1e-5);
    double a = 0, bsum = 0;
    for (size_t c = 0; c < C; ++c) {
      const double nrm = (x[n * C + c] - m) * rs, dn = w[c] * dy[n * C + c];
      a += dn / C;
      bsum += dn * nrm / C;
      dw[c] += nrm * dy[n * C + c];
      db[c] += dy[n * C + c];
    }
    for (size_t c = 0; c < C; ++c)
      dx[n * C + c] = rs * (w[c] * dy[n * C + c] - a - (x[n * C + c] - m) * rs * bsum);
  }
}

double RefGelu(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double RefGeluGrad(double x) {
  const double k = std::sqrt(2 / M_PI), th = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k * (1 + 3 * 0.044715 * x * x);
}

// Causal attention; att (B, NH, T, T) probabilities.
void RefAttention(DVec& y, DVec& att, const DVec& qkv, size_t B, size_t T, size_t C, size_t NH) {
  const size_t hs = C / NH;
  y.assign(B * T * C, 0.0);
  att.assign(B * NH * T * T, 0.0);
  for (size_t b = 0; b < B; ++b)
    for (size_t h = 0; h < NH; ++h)
      for (size_t t = 0; t < T; ++t) {
        double* a = &att[((b * NH + h) * T + t) * T];
        double z = 0;
        for (size_t u = 0; u <= t; ++u) {
          double s = 0;
          for (size_t i = 0; i < hs; ++i)
            s += qkv[(b * T + t) * 3 * C + h * hs + i] * qkv[(b * T + u) * 3 * C + C + h * hs + i];
          a[u] = std::exp(s / std::sqrt(static_cast<double>(hs)));
          z += a[u];
        }
        for (size_t u = 0; u <= t; ++u) a[u] /= z;
        for (size_t u = 0; u <= t; ++u)
          for (size_t i = 0; i < hs; ++i)
            y[(b * T + t) * C + h * hs + i] += a[u] * qkv[(b * T + u) * 3 * C + 2 * C + h * hs + i];
      }
}
void RefAttentionBack(DVec& dqkv, const DVec& dy, const DVec& qkv, const DVec& att, size_t B, size_t T,
                      size_t C, size_t NH) {
  const size_t hs = C / NH;
  const double sc = 1 / std::sqrt(static_cast<double>(hs));
  dqkv.assign(B * T * 3 * C, 0.0);
  auto at = [&](size_t b, size_t t, size_t part, size_t h, size_t i) {
    return (b * T + t) * 3 * C + part * C + h * hs + i;
  };
  for (size_t b = 0; b < B; ++b)
    for (size_t h = 0; h < NH; ++h)
      for (size_t t = 0; t < T; ++t) {
        const double* a = &att[((b * NH + h) * T + t) * T];
        DVec da(t + 1, 0.0);
        for (size_t u = 0; u <= t; ++u)
          for (size_t i = 0; i < hs; ++i) {
            const double g = dy[(b * T + t) * C + h * hs + i];
            da[u] += g * qkv[at(b, u, 2, h, i)];
            dqkv[at(b, u, 2, h, i)] += a[u] * g;
          }
        for (size_t u = 0; u <= t; ++u) {
          double ds = 0;  // d score_u = Σ_j da_j · ∂a_j/∂s_u = a_u · (da_u - Σ_j a_j da_j)
          for (size_t j = 0; j <= t; ++j) ds += da[j] * a[j] * ((j == u ? 1.0 : 0.0) - a[u]);
          for (size_t i = 0; i < hs; ++i) {
            dqkv[at(b, t, 0, h, i)] += ds * sc * qkv[at(b, u, 1, h, i)];
            dqkv[at(b, u, 1, h, i)] += ds * sc * qkv[at(b, t, 0, h, i)];
          }
        }
      }
}

// Loss and gradient (embed group, then each block's group) of the whole model.
struct RefResult {
  double loss = 0;
  DVec dembed;
  std::vector<DVec> dblocks;
};

RefResult RefModel(const DVec& embed, const std::vector<DVec>& blocks, const std::vector<int32_t>& tokens,
                   const std::vector<int32_t>& targets) {
  const size_t C = kCfg.channels, V = kCfg.vocab, NH = kCfg.heads, L = kCfg.layers, N = kB * kT;
  const auto et = EmbedParamTensors(kCfg);
  const auto bt = BlockParamTensors(kCfg);
  const double *wte = &embed[et[kWte].offset], *wpe = &embed[et[kWpe].offset];
  RefResult r;
  r.dembed.assign(embed.size(), 0.0);
  r.dblocks.assign(L, DVec(blocks[0].size(), 0.0));
  // Forward, keeping every intermediate of every block.
  struct Saved {
    DVec x, ln1, qkv, att, atty, res2, ln2, fch, fcg;
  };
  std::vector<Saved> s(L);
  DVec x(N * C);
  for (size_t n = 0; n < N; ++n)
    for (size_t c = 0; c < C; ++c) x[n * C + c] = wte[tokens[n] * C + c] + wpe[(n % kT) * C + c];
  for (size_t l = 0; l < L; ++l) {
    const double* p = blocks[l].data();
    Saved& k = s[l];
    k.x = x;
    DVec tmp;
    RefLayerNorm(k.ln1, x, p + bt[kLn1Weight].offset, p + bt[kLn1Bias].offset, N, C);
    RefLinear(k.qkv, k.ln1, p + bt[kQkvWeight].offset, p + bt[kQkvBias].offset, N, C, 3 * C);
    RefAttention(k.atty, k.att, k.qkv, kB, kT, C, NH);
    RefLinear(tmp, k.atty, p + bt[kAttnProjWeight].offset, p + bt[kAttnProjBias].offset, N, C, C);
    k.res2 = x;
    for (size_t i = 0; i < N * C; ++i) k.res2[i] += tmp[i];
    RefLayerNorm(k.ln2, k.res2, p + bt[kLn2Weight].offset, p + bt[kLn2Bias].offset, N, C);
    RefLinear(k.fch, k.ln2, p + bt[kFcWeight].offset, p + bt[kFcBias].offset, N, C, 4 * C);
    k.fcg = k.fch;
    for (double& v : k.fcg) v = RefGelu(v);
    RefLinear(tmp, k.fcg, p + bt[kFcProjWeight].offset, p + bt[kFcProjBias].offset, N, 4 * C, C);
    for (size_t i = 0; i < N * C; ++i) x[i] = k.res2[i] + tmp[i];
  }
  DVec lnf, logits;
  RefLayerNorm(lnf, x, &embed[et[kLnfWeight].offset], &embed[et[kLnfBias].offset], N, C);
  RefLinear(logits, lnf, wte, nullptr, N, C, V);
  DVec dlogits(N * V);
  for (size_t n = 0; n < N; ++n) {
    double z = 0;
    for (size_t v = 0; v < V; ++v) z += std::exp(logits[n * V + v]);
    r.loss += (std::log(z) - logits[n * V + targets[n]]) / N;
    for (size_t v = 0; v < V; ++v)
      dlogits[n * V + v] = (std::exp(logits[n * V + v]) / z - (static_cast<int32_t>(v) == targets[n])) / N;
  }
  // Backward.
  DVec dlnf, dx, d1, d2;
  double* dwte = &r.dembed[et[kWte].offset];
  RefLinearBack(dlnf, dwte, nullptr, dlogits, lnf, wte, N, C, V);
  RefLayerNormBack(dx, &r.dembed[et[kLnfWeight].offset], &r.dembed[et[kLnfBias].offset], dlnf, x,
                   &embed[et[kLnfWeight].offset], N, C);
  for (size_t l = L; l-- > 0;) {
    const double* p = blocks[l].data();
    double* g = r.dblocks[l].data();
    const Saved& k = s[l];
    DVec dres2 = dx;
    RefLinearBack(d1, g + bt[kFcProjWeight].offset, g + bt[kFcProjBias].offset, dx, k.fcg,
                  p + bt[kFcProjWeight].offset, N, 4 * C, C);
    for (size_t i = 0; i < d1.size(); ++i) d1[i] *= RefGeluGrad(k.fch[i]);
    RefLinearBack(d2, g + bt[kFcWeight].offset, g + bt[kFcBias].offset, d1, k.ln2, p + bt[kFcWeight].offset,
                  N, C, 4 * C);
    RefLayerNormBack(d1, g + bt[kLn2Weight].offset, g + bt[kLn2Bias].offset, d2, k.res2,
                     p + bt[kLn2Weight].offset, N, C);
    for (size_t i = 0; i < N * C; ++i) dres2[i] += d1[i];
    RefLinearBack(d1, g + bt[kAttnProjWeight].offset, g + bt[kAttnProjBias].offset, dres2, k.atty,
                  p + bt[kAttnProjWeight].offset, N, C, C);
    RefAttentionBack(d2, d1, k.qkv, k.att, kB, kT, C, NH);
    RefLinearBack(d1, g + bt[kQkvWeight].offset, g + bt[kQkvBias].offset, d2, k.ln1,
                  p + bt[kQkvWeight].offset, N, C, 3 * C);
    RefLayerNormBack(d2, g + bt[kLn1Weight].offset, g + bt[kLn1Bias].offset, d1, k.x,
                     p + bt[kLn1Weight].offset, N, C);
    for (size_t i = 0; i < N * C; ++i) dx[i] = dres2[i] + d2[i];
  }
  for (size_t n = 0; n < N; ++n)
    for (size_t c = 0; c < C; ++c) {
      r.dembed[et[kWte].offset + tokens[n] * C + c] += dx[n * C + c];
      r.dembed[et[kWpe].offset + (n % kT) * C + c] += dx[n * C + c];
    }
  return r;
}

// ---- the layer kernels, composed the way the trainer does -------------------

struct KernelResult {
  float loss = 0;
  Vec dembed;
  std::vector<Vec> dblocks;
};

// Forward keeps only each block's input (activation checkpointing); the
// backward recomputes each block from it.
KernelResult KernelModel(const Vec& embed, const std::vector<Vec>& blocks, const std::vector<int32_t>& tokens,
                         const std::vector<int32_t>& targets) {
  const size_t C = kCfg.channels, L = kCfg.layers, NC = kB * kT * C;
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
  KernelResult r;
  r.dembed.assign(embed.size(), 0.0f);
  r.dblocks.assign(L, Vec(blocks[0].size(), 0.0f));
  Vec dx(NC);
  r.loss = HeadForwardBackward(kCfg, embed.data(), xs[L].data(), targets.data(), kB, kT, &head, dx.data(),
                               r.dembed.data());
  for (size_t l = L; l-- > 0;) {
    BlockBackward(kCfg, blocks[l].data(), xs[l].data(), dx.data(), &acts, BlockBackwardMode::kRecompute,
                  r.dblocks[l].data(), dx.data(), kB, kT);
  }
  EncoderBackward(r.dembed.data() + et[kWte].offset, r.dembed.data() + et[kWpe].offset, dx.data(),
                  tokens.data(), kB, kT, C);
  return r;
}

DVec ToDouble(const Vec& v) { return DVec(v.begin(), v.end()); }

class ModelReference : public ::testing::Test {
 protected:
  void SetUp() override {
    embed_ = Random(EmbedParamCount(kCfg), 100, -0.5f, 0.5f);
    const auto et = EmbedParamTensors(kCfg);
    for (size_t j = 0; j < kCfg.channels; ++j) embed_[et[kLnfWeight].offset + j] += 1.0f;
    const auto bt = BlockParamTensors(kCfg);
    for (int l = 0; l < kCfg.layers; ++l) {
      Vec p = Random(BlockParamCount(kCfg), 200 + l, -0.3f, 0.3f);
      for (int i : {kLn1Weight, kLn2Weight})
        for (size_t j = 0; j < bt[i].count; ++j) p[bt[i].offset + j] += 1.0f;
      blocks_.push_back(p);
      dblocks_.push_back(ToDouble(p));
    }
    tokens_ = RandomTokens(kB * kT, kCfg.vocab, 300);
    targets_ = RandomTokens(kB * kT, kCfg.vocab, 301);
  }
  Vec embed_;
  std::vector<Vec> blocks_;
  std::vector<DVec> dblocks_;
  std::vector<int32_t> tokens_, targets_;
};

// Compares a kernel gradient with the reference's, tensor by tensor:
// |g - ref| <= 1e-5 · max|ref over the tensor| + 1e-8. The fp32 kernels'
// errors measured here stay below 5e-7 of the tensor's largest value (printed):
// a few fp32 ulps through two blocks, so 1e-5 leaves 20x room.
template <size_t K>
void ExpectClose(const char* group, const std::array<ParamTensor, K>& tensors, const Vec& g,
                 const DVec& ref) {
  for (const ParamTensor& t : tensors) {
    double scale = 0, worst = 0;
    for (size_t j = t.offset; j < t.offset + t.count; ++j) scale = std::max(scale, std::fabs(ref[j]));
    for (size_t j = t.offset; j < t.offset + t.count; ++j) {
      const double err = std::fabs(g[j] - ref[j]);
      worst = std::max(worst, err / (scale + 1e-30));
      ASSERT_LE(err, 1e-5 * scale + 1e-8) << group << "." << t.name << "[" << j - t.offset << "]";
    }
    std::printf("%-6s %-17s max|ref| %.3e  worst |error|/max|ref| %.2e\n", group, t.name, scale, worst);
  }
}

TEST_F(ModelReference, LossAndEveryGradientMatch) {
  const RefResult ref = RefModel(ToDouble(embed_), dblocks_, tokens_, targets_);
  const KernelResult got = KernelModel(embed_, blocks_, tokens_, targets_);
  EXPECT_NEAR(got.loss, ref.loss, 1e-5 * ref.loss);
  EXPECT_GT(ref.loss, 1.0);
  ExpectClose("embed", EmbedParamTensors(kCfg), got.dembed, ref.dembed);
  for (int l = 0; l < kCfg.layers; ++l)
    ExpectClose("block", BlockParamTensors(kCfg), got.dblocks[l], ref.dblocks[l]);
}

// The reference's backward against fp64 central differences (step 1e-5: the
// error is ~1e-10 truncation plus ~1e-11 rounding, far under the 1e-7 allowed).
TEST_F(ModelReference, ReferenceGradientMatchesFiniteDifferences) {
  DVec embed = ToDouble(embed_);
  std::vector<DVec> blocks = dblocks_;
  const RefResult ref = RefModel(embed, blocks, tokens_, targets_);
  auto check = [&](DVec& x, const DVec& g, size_t stride, const char* what) {
    for (size_t i = 0; i < x.size(); i += stride) {
      const double x0 = x[i], h = 1e-5;
      x[i] = x0 + h;
      const double up = RefModel(embed, blocks, tokens_, targets_).loss;
      x[i] = x0 - h;
      const double down = RefModel(embed, blocks, tokens_, targets_).loss;
      x[i] = x0;
      ASSERT_NEAR(g[i], (up - down) / (2 * h), 1e-7) << what << "[" << i << "]";
    }
  };
  check(embed, ref.dembed, 7, "embed");
  for (int l = 0; l < kCfg.layers; ++l) check(blocks[l], ref.dblocks[l], 23, "block");
}

}  // namespace
}  // namespace strata::layers::test
