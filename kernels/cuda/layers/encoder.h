// Token + position embedding on the GPU: the CPU layer's contract
// (kernels/cpu/layers/encoder.h) on fp32 device pointers; tokens are int32 on
// the device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// out (B, T, C) = wte[tokens[b, t]] + wpe[t]; wte (V, C), wpe (>= T, C).
// REQUIRES: tokens in [0, V) — the caller checks them on the host (a kernel
// cannot abort); a row whose token is out of range becomes NaN, so that the
// loss shows it, and never reads outside wte.
Status EncoderForwardCuda(const CudaLayerContext& ctx, float* out, const int32_t* tokens, const float* wte,
                          const float* wpe, size_t B, size_t T, size_t C, size_t V);

// Accumulates (+=): dwte (V, C) rows of the tokens seen, dwpe (T, C) rows
// 0..T-1, from dout (B, T, C), each sum over (b, t) in order (no atomics).
// dwte costs V·B·T·C reads of a token id (shared by a warp): cheap for the
// byte-level vocabulary (V = 256); a large vocabulary would want a sort.
Status EncoderBackwardCuda(const CudaLayerContext& ctx, float* dwte, float* dwpe, const float* dout,
                           const int32_t* tokens, size_t B, size_t T, size_t C, size_t V);

}  // namespace strata::layers
