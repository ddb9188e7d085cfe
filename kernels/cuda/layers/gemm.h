// Private to the CUDA layers: cuBLAS GEMMs with fp32 output and fp32
// accumulation, in cuBLAS's own column-major terms. The callers translate
// their row-major tensors: a row-major (R, K) matrix is the column-major
// (K x R) matrix with leading dimension K, i.e. its transpose.
#pragma once

#include <cublas_v2.h>

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers::cuda_detail {

// C (m x n, ldc) = alpha · op_a(A) · op_b(B) + beta · C, column-major, where
// op_a(A) is m x k and op_b(B) is k x n.
struct GemmShape {
  cublasOperation_t op_a, op_b;
  size_t m, n, k;
  size_t lda, ldb, ldc;
};

cudaDataType_t CudaDataType(DType dtype);

// A and B hold `ab` elements; C is fp32. compute: CUBLAS_COMPUTE_32F (fp32
// accumulation; tensor cores for bf16/f16 inputs, plain fp32 for f32 ones) or
// CUBLAS_COMPUTE_32F_FAST_TF32. Dimensions above INT_MAX are an InvalidError.
Status Gemm(const CudaLayerContext& ctx, const GemmShape& s, float alpha, const void* a, const void* b,
            cudaDataType_t ab, float beta, float* c, cublasComputeType_t compute);

// `batch` independent GEMMs of one shape; matrix i of A, B, C starts
// stride_a, stride_b, stride_c elements after matrix i-1.
Status GemmStridedBatched(const CudaLayerContext& ctx, const GemmShape& s, float alpha, const void* a,
                          size_t stride_a, const void* b, size_t stride_b, cudaDataType_t ab, float beta,
                          float* c, size_t stride_c, size_t batch, cublasComputeType_t compute);

}  // namespace strata::layers::cuda_detail
