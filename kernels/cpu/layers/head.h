// The model's end: final LayerNorm, the LM head tied to wte, softmax
// cross-entropy averaged over tokens. It reads only the embedding group
// (wte, wpe, lnf.weight, lnf.bias; see gpt_config.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/layers/gpt_config.h"

namespace strata::layers {

// Logits are made this many rows at a time, so the workspace holds
// kHeadChunkRows x V logits instead of B·T x V.
inline constexpr size_t kHeadChunkRows = 64;

// Workspace of the head, sized by HeadActsInit for (cfg, B, T); reusable.
struct HeadActs {
  size_t B = 0, T = 0;
  std::vector<float> mem;     // one allocation cut into the views below
  float* lnf = nullptr;       // (B, T, C) final LayerNorm output
  float* lnf_mean = nullptr;  // (B, T)
  float* lnf_rstd = nullptr;  // (B, T)
  float* losses = nullptr;    // (B, T) per-token loss
  float* logits = nullptr;    // (kHeadChunkRows, V) one chunk of logits, then dlogits
  float* dlnf = nullptr;      // (B, T, C)
};
void HeadActsInit(HeadActs* acts, const GptConfig& cfg, size_t B, size_t T);

// x (B, T, C): the last block's output; targets (B, T) in [0, V).
// Returns the mean loss over the B·T tokens (per-token losses summed in order
// in fp64). When dx is not null, also the backward of that mean:
// dx (B, T, C) is set (=), and dembed (the embedding group's gradient, same
// layout as embed_params) accumulates (+=) into wte and lnf; wpe untouched.
// REQUIRES: HeadActsInit(acts, cfg, B, T); T <= cfg.context; dx does not overlap x.
float HeadForwardBackward(const GptConfig& cfg, const float* embed_params, const float* x,
                          const int32_t* targets, size_t B, size_t T, HeadActs* acts, float* dx,
                          float* dembed);

}  // namespace strata::layers
