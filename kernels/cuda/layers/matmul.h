// Linear layer on the GPU: out = inp · Wᵀ + b with W (OC, C) row-major, the
// CPU layer's contract (kernels/cpu/layers/matmul.h) on device pointers.
//
// The weight stays in the engine's compute dtype (bf16, f16 or f32) and the
// fp32 activations are rounded to it into scratch, so that cuBLAS multiplies
// two tensors of one type with fp32 accumulation (CUBLAS_COMPUTE_32F: tensor
// cores for bf16/f16); outputs, bias and every gradient stay fp32. With f32
// the GEMMs are plain fp32 and nothing is rounded.
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers {

// Scratch of MatmulForwardCuda and MatmulBackwardCuda for these sizes.
size_t MatmulScratchBytes(size_t N, size_t C, size_t OC, DType dtype);

// out (N, OC) = inp (N, C) · weight (OC, C)ᵀ + bias (OC). weight holds OC·C
// values of `dtype`; bias (fp32) may be null. out must not overlap inp.
Status MatmulForwardCuda(const CudaLayerContext& ctx, float* out, const float* inp, const void* weight,
                         DType dtype, const float* bias, size_t N, size_t C, size_t OC, CudaScratch scratch);

// Accumulates (+=): dinp (N, C) += dout (N, OC) · weight; dweight (OC, C) +=
// doutᵀ · inp; dbias (OC) += Σ_rows dout. dinp and dbias may be null.
Status MatmulBackwardCuda(const CudaLayerContext& ctx, float* dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, const void* weight, DType dtype, size_t N,
                          size_t C, size_t OC, CudaScratch scratch);

}  // namespace strata::layers
