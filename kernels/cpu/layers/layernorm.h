// LayerNorm over the channels of each row (GPT-2's pre-norm), eps = 1e-5.
#pragma once

#include <cstddef>

namespace strata::layers {

inline constexpr float kLayerNormEps = 1e-5f;

// out (N, C) = (inp - mean) · rstd · weight (C) + bias (C), where per row
// mean (N) and rstd (N) = 1/sqrt(biased variance + eps) are written for the
// backward. Mean and variance are summed in fp64. out must not overlap inp.
void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, size_t N, size_t C);

// Accumulates (+=): dinp (N, C), dweight (C), dbias (C), from dout (N, C) and
// the forward's inp, weight, mean, rstd. dweight and dbias sum rows in order.
void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, const float* mean, const float* rstd, size_t N, size_t C);

}  // namespace strata::layers
