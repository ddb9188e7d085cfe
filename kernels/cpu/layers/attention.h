// Causal multi-head self-attention from a fused qkv buffer. The forward saves
// the softmax probabilities (B, NH, T, T) and the backward reads them; a block
// that checkpoints recomputes them with the rest of its forward.
#pragma once

#include <cstddef>

namespace strata::layers {

// qkv (B, T, 3C): per position q | k | v, each C wide, head h at [h*hs, (h+1)*hs),
// hs = C / NH. att (B, NH, T, T): row t holds softmax_t2(q_t·k_t2 / sqrt(hs))
// for t2 <= t and zeros after. out (B, T, C): head h at [h*hs, (h+1)*hs) is
// Σ_t2 att[t][t2] · v_t2.
void AttentionForward(float* out, float* att, const float* qkv, size_t B, size_t T, size_t C, size_t NH);

// Accumulates (+=): dqkv (B, T, 3C) from dout (B, T, C), the forward's qkv and att.
// Each (b, h) walks t in order, so key and value gradients sum in a fixed order.
void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, size_t B, size_t T,
                       size_t C, size_t NH);

}  // namespace strata::layers
