// Causal multi-head self-attention on the GPU: the CPU layer's contract
// (kernels/cpu/layers/attention.h) on fp32 device pointers. Scores and outputs
// are batched GEMMs over the B·NH heads with the (B, NH, T, T) probabilities
// materialised, as the CPU layer saves them.
//
// GEMM precision: with dtype f32 plain fp32; otherwise (bf16, f16) TF32 tensor
// cores on the fp32 tensors (10-bit mantissa, finer than the bf16 the linear
// layers round to), fp32 accumulation either way. Softmax in fp32.
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

size_t AttentionScratchBytes(size_t B, size_t T, size_t C, size_t NH);

// qkv (B, T, 3C) → out (B, T, C) and att (B, NH, T, T): row t holds
// softmax_t2(q_t·k_t2 / sqrt(hs)) for t2 <= t and zeros after.
Status AttentionForwardCuda(const CudaLayerContext& ctx, float* out, float* att, const float* qkv, size_t B,
                            size_t T, size_t C, size_t NH, DType dtype, CudaScratch scratch);

// Accumulates (+=): dqkv (B, T, 3C) from dout (B, T, C), the forward's qkv and att.
Status AttentionBackwardCuda(const CudaLayerContext& ctx, float* dqkv, const float* dout, const float* qkv,
                             const float* att, size_t B, size_t T, size_t C, size_t NH, DType dtype,
                             CudaScratch scratch);

}  // namespace strata::layers
