// Token + position embedding: the model's first layer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::layers {

// out (B, T, C) = wte[tokens[b, t]] + wpe[t]; tokens (B, T) in [0, V),
// wte (V, C), wpe (>= T, C). A token out of range aborts (STRATA_CHECK).
void EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, size_t B, size_t T,
                    size_t C, size_t V);

// Accumulates (+=): dwte (V, C) rows of the tokens seen, dwpe (T, C) rows 0..T-1,
// from dout (B, T, C), summing (b, t) in order.
void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, size_t B, size_t T,
                     size_t C);

}  // namespace strata::layers
