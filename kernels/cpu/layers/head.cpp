// Final LayerNorm → tied LM head → cross-entropy, the logits made and consumed
// one fixed chunk of rows at a time (chunks in order: wte's gradient sums
// them in a fixed order).
#include "kernels/cpu/layers/head.h"

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "kernels/cpu/layers/cross_entropy.h"
#include "kernels/cpu/layers/layernorm.h"
#include "kernels/cpu/layers/matmul.h"

namespace strata::layers {

void HeadActsInit(HeadActs* acts, const GptConfig& cfg, size_t B, size_t T) {
  const size_t C = static_cast<size_t>(cfg.channels), V = static_cast<size_t>(cfg.vocab), N = B * T;
  const size_t chunk = std::min(N, kHeadChunkRows);
  acts->B = B;
  acts->T = T;
  acts->mem.assign(2 * N * C + 3 * N + chunk * V, 0.0f);
  float* p = acts->mem.data();
  auto take = [&p](size_t n) {
    float* v = p;
    p += n;
    return v;
  };
  acts->lnf = take(N * C);
  acts->lnf_mean = take(N);
  acts->lnf_rstd = take(N);
  acts->losses = take(N);
  acts->logits = take(chunk * V);
  acts->dlnf = take(N * C);
}

float HeadForwardBackward(const GptConfig& cfg, const float* embed_params, const float* x,
                          const int32_t* targets, size_t B, size_t T, HeadActs* acts, float* dx,
                          float* dembed) {
  STRATA_CHECK_MSG(acts->B == B && acts->T == T, "HeadActs sized for another (B, T)");
  STRATA_CHECK(T <= static_cast<size_t>(cfg.context));
  const size_t C = static_cast<size_t>(cfg.channels), V = static_cast<size_t>(cfg.vocab), N = B * T;
  const auto tensors = EmbedParamTensors(cfg);
  const float* wte = embed_params + tensors[kWte].offset;
  const float* lnfw = embed_params + tensors[kLnfWeight].offset;
  const float* lnfb = embed_params + tensors[kLnfBias].offset;
  LayerNormForward(acts->lnf, acts->lnf_mean, acts->lnf_rstd, x, lnfw, lnfb, N, C);
  const bool backward = dx != nullptr;
  if (backward) std::memset(acts->dlnf, 0, N * C * sizeof(float));
  const float dloss = 1.0f / static_cast<float>(N);
  for (size_t r0 = 0; r0 < N; r0 += kHeadChunkRows) {
    const size_t rows = std::min(kHeadChunkRows, N - r0);
    MatmulForward(acts->logits, acts->lnf + r0 * C, wte, nullptr, rows, C, V);
    CrossEntropyForwardBackward(acts->losses + r0, backward ? acts->logits : nullptr, acts->logits,
                                targets + r0, rows, V, dloss);
    if (!backward) continue;
    MatmulBackward(acts->dlnf + r0 * C, dembed + tensors[kWte].offset, nullptr, acts->logits,
                   acts->lnf + r0 * C, wte, rows, C, V);
  }
  double sum = 0;
  for (size_t r = 0; r < N; ++r) sum += acts->losses[r];
  if (backward) {
    std::memset(dx, 0, N * C * sizeof(float));
    LayerNormBackward(dx, dembed + tensors[kLnfWeight].offset, dembed + tensors[kLnfBias].offset, acts->dlnf,
                      x, lnfw, acts->lnf_mean, acts->lnf_rstd, N, C);
  }
  return static_cast<float>(sum / static_cast<double>(N));
}

}  // namespace strata::layers
