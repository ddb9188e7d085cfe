// Element-wise layers on the GPU, fp32 device pointers: GELU (tanh
// approximation) and the residual add; the CPU layer's contract
// (kernels/cpu/layers/elementwise.h).
#pragma once

#include <cstddef>

#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// out (n) = 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))). out may equal inp.
Status GeluForwardCuda(const CudaLayerContext& ctx, float* out, const float* inp, size_t n);
// Accumulates (+=): dinp (n) += gelu'(inp) · dout. dinp must not overlap dout.
Status GeluBackwardCuda(const CudaLayerContext& ctx, float* dinp, const float* inp, const float* dout,
                        size_t n);
// out (n) = a + b. out may equal a or b.
Status ResidualForwardCuda(const CudaLayerContext& ctx, float* out, const float* a, const float* b, size_t n);

}  // namespace strata::layers
