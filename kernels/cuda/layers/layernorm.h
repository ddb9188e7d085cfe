// LayerNorm on the GPU: the CPU layer's contract (kernels/cpu/layers/layernorm.h,
// eps = kLayerNormEps) on device pointers, all fp32. Row statistics are summed
// in fp32 (two passes: mean, then squared deviations) where the CPU uses fp64.
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// out (N, C) = (inp - mean) · rstd · weight + bias; mean (N), rstd (N) saved.
// out must not overlap inp.
Status LayerNormForwardCuda(const CudaLayerContext& ctx, float* out, float* mean, float* rstd,
                            const float* inp, const float* weight, const float* bias, size_t N, size_t C);

size_t LayerNormBackwardScratchBytes(size_t C);

// Accumulates (+=): dinp (N, C), dweight (C), dbias (C), from dout (N, C) and
// the forward's inp, weight, mean, rstd. dinp must not overlap dout or inp.
Status LayerNormBackwardCuda(const CudaLayerContext& ctx, float* dinp, float* dweight, float* dbias,
                             const float* dout, const float* inp, const float* weight, const float* mean,
                             const float* rstd, size_t N, size_t C, CudaScratch scratch);

}  // namespace strata::layers
