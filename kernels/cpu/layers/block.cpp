// A block's forward and backward composed from the layer kernels.
#include "kernels/cpu/layers/block.h"

#include <cstring>

#include "base/check.h"
#include "kernels/cpu/layers/attention.h"
#include "kernels/cpu/layers/elementwise.h"
#include "kernels/cpu/layers/layernorm.h"
#include "kernels/cpu/layers/matmul.h"

namespace strata::layers {
namespace {

struct Dims {
  size_t C, NH, N;
};

Dims DimsOf(const GptConfig& cfg, size_t B, size_t T) {
  return Dims{static_cast<size_t>(cfg.channels), static_cast<size_t>(cfg.heads), B * T};
}

// Pointers to the block's tensors inside one flat buffer (params or grads).
template <typename F>
struct BlockTensors {
  F* t[kBlockTensorCount];
  BlockTensors(const GptConfig& cfg, F* base) {
    const auto layout = BlockParamTensors(cfg);
    for (int i = 0; i < kBlockTensorCount; ++i) t[i] = base + layout[i].offset;
  }
  F* operator[](int i) const { return t[i]; }
};

void Zero(float* p, size_t n) { std::memset(p, 0, n * sizeof(float)); }

}  // namespace

size_t BlockActsFloats(const GptConfig& cfg, size_t B, size_t T) {
  const size_t C = static_cast<size_t>(cfg.channels), NH = static_cast<size_t>(cfg.heads), N = B * T;
  return 31 * N * C + 4 * N + B * NH * T * T;
}

void BlockActsInit(BlockActs* a, const GptConfig& cfg, size_t B, size_t T) {
  const size_t C = static_cast<size_t>(cfg.channels), NH = static_cast<size_t>(cfg.heads), N = B * T;
  a->B = B;
  a->T = T;
  a->mem.assign(BlockActsFloats(cfg, B, T), 0.0f);
  float* p = a->mem.data();
  auto take = [&p](size_t n) {
    float* v = p;
    p += n;
    return v;
  };
  a->ln1 = take(N * C);
  a->ln1_mean = take(N);
  a->ln1_rstd = take(N);
  a->qkv = take(3 * N * C);
  a->att = take(B * NH * T * T);
  a->atty = take(N * C);
  a->res2 = take(N * C);
  a->ln2 = take(N * C);
  a->ln2_mean = take(N);
  a->ln2_rstd = take(N);
  a->fch = take(4 * N * C);
  a->fch_gelu = take(4 * N * C);
  a->branch = take(N * C);
  a->dres2 = take(N * C);
  a->dfch_gelu = take(4 * N * C);
  a->dfch = take(4 * N * C);
  a->dln2 = take(N * C);
  a->datty = take(N * C);
  a->dqkv = take(3 * N * C);
  a->dln1 = take(N * C);
  STRATA_CHECK(p == a->mem.data() + a->mem.size());
}

void BlockForward(const GptConfig& cfg, const float* params, const float* x_in, float* x_out, BlockActs* a,
                  size_t B, size_t T) {
  STRATA_CHECK_MSG(a->B == B && a->T == T, "BlockActs sized for another (B, T)");
  STRATA_CHECK(T <= static_cast<size_t>(cfg.context));
  const Dims d = DimsOf(cfg, B, T);
  const BlockTensors<const float> p(cfg, params);
  LayerNormForward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, p[kLn1Weight], p[kLn1Bias], d.N, d.C);
  MatmulForward(a->qkv, a->ln1, p[kQkvWeight], p[kQkvBias], d.N, d.C, 3 * d.C);
  AttentionForward(a->atty, a->att, a->qkv, B, T, d.C, d.NH);
  MatmulForward(a->branch, a->atty, p[kAttnProjWeight], p[kAttnProjBias], d.N, d.C, d.C);
  ResidualForward(a->res2, x_in, a->branch, d.N * d.C);
  LayerNormForward(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, p[kLn2Weight], p[kLn2Bias], d.N, d.C);
  MatmulForward(a->fch, a->ln2, p[kFcWeight], p[kFcBias], d.N, d.C, 4 * d.C);
  GeluForward(a->fch_gelu, a->fch, 4 * d.N * d.C);
  MatmulForward(a->branch, a->fch_gelu, p[kFcProjWeight], p[kFcProjBias], d.N, 4 * d.C, d.C);
  ResidualForward(x_out, a->res2, a->branch, d.N * d.C);
}

void BlockBackward(const GptConfig& cfg, const float* params, const float* x_in, const float* dx_out,
                   BlockActs* a, BlockBackwardMode mode, float* dparams, float* dx_in, size_t B, size_t T) {
  STRATA_CHECK_MSG(a->B == B && a->T == T, "BlockActs sized for another (B, T)");
  // The recomputed x_out is not needed; it lands in `branch`, which the backward does not read.
  if (mode == BlockBackwardMode::kRecompute) BlockForward(cfg, params, x_in, a->branch, a, B, T);
  const Dims d = DimsOf(cfg, B, T);
  const size_t NC = d.N * d.C;
  const BlockTensors<const float> p(cfg, params);
  const BlockTensors<float> g(cfg, dparams);
  // x_out = res2 + mlp: both get dx_out. Copy it first so that dx_in may alias it.
  std::memcpy(a->dres2, dx_out, NC * sizeof(float));
  Zero(a->dfch_gelu, 4 * NC);
  MatmulBackward(a->dfch_gelu, g[kFcProjWeight], g[kFcProjBias], a->dres2, a->fch_gelu, p[kFcProjWeight], d.N,
                 4 * d.C, d.C);
  Zero(a->dfch, 4 * NC);
  GeluBackward(a->dfch, a->fch, a->dfch_gelu, 4 * NC);
  Zero(a->dln2, NC);
  MatmulBackward(a->dln2, g[kFcWeight], g[kFcBias], a->dfch, a->ln2, p[kFcWeight], d.N, d.C, 4 * d.C);
  LayerNormBackward(a->dres2, g[kLn2Weight], g[kLn2Bias], a->dln2, a->res2, p[kLn2Weight], a->ln2_mean,
                    a->ln2_rstd, d.N, d.C);
  // res2 = x_in + attn: both get dres2.
  Zero(a->datty, NC);
  MatmulBackward(a->datty, g[kAttnProjWeight], g[kAttnProjBias], a->dres2, a->atty, p[kAttnProjWeight], d.N,
                 d.C, d.C);
  Zero(a->dqkv, 3 * NC);
  AttentionBackward(a->dqkv, a->datty, a->qkv, a->att, B, T, d.C, d.NH);
  Zero(a->dln1, NC);
  MatmulBackward(a->dln1, g[kQkvWeight], g[kQkvBias], a->dqkv, a->ln1, p[kQkvWeight], d.N, d.C, 3 * d.C);
  std::memcpy(dx_in, a->dres2, NC * sizeof(float));
  LayerNormBackward(dx_in, g[kLn1Weight], g[kLn1Bias], a->dln1, x_in, p[kLn1Weight], a->ln1_mean, a->ln1_rstd,
                    d.N, d.C);
}

}  // namespace strata::layers
