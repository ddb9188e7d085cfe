// cublasGemmEx and cublasGemmStridedBatchedEx behind a dimension check.
#include "kernels/cuda/layers/gemm.h"

#include <climits>
#include <string>

#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers::cuda_detail {
namespace {

Status CheckInt(const char* what, size_t v) {
  if (v <= static_cast<size_t>(INT_MAX)) return Status::Ok();
  return InvalidError(std::string("GEMM ") + what + " " + std::to_string(v) + " exceeds cuBLAS's int range");
}

Status CheckShape(const GemmShape& s) {
  STRATA_RETURN_IF_ERROR(CheckInt("m", s.m));
  STRATA_RETURN_IF_ERROR(CheckInt("n", s.n));
  STRATA_RETURN_IF_ERROR(CheckInt("k", s.k));
  STRATA_RETURN_IF_ERROR(CheckInt("lda", s.lda));
  STRATA_RETURN_IF_ERROR(CheckInt("ldb", s.ldb));
  return CheckInt("ldc", s.ldc);
}

// The handle is the caller's and may have been used on another stream or in
// device pointer mode since: bind it to this call's stream, alpha and beta on the host.
Status Bind(const CudaLayerContext& ctx) {
  STRATA_BLAS_OK("cublasSetStream", cublasSetStream(ctx.blas, ctx.stream));
  STRATA_BLAS_OK("cublasSetPointerMode", cublasSetPointerMode(ctx.blas, CUBLAS_POINTER_MODE_HOST));
  return Status::Ok();
}

}  // namespace

cudaDataType_t CudaDataType(DType dtype) {
  if (dtype == DType::kBF16) return CUDA_R_16BF;
  if (dtype == DType::kF16) return CUDA_R_16F;
  return CUDA_R_32F;
}

Status Gemm(const CudaLayerContext& ctx, const GemmShape& s, float alpha, const void* a, const void* b,
            cudaDataType_t ab, float beta, float* c, cublasComputeType_t compute) {
  STRATA_RETURN_IF_ERROR(CheckShape(s));
  STRATA_RETURN_IF_ERROR(Bind(ctx));
  STRATA_BLAS_OK("cublasGemmEx",
                 cublasGemmEx(ctx.blas, s.op_a, s.op_b, static_cast<int>(s.m), static_cast<int>(s.n),
                              static_cast<int>(s.k), &alpha, a, ab, static_cast<int>(s.lda), b, ab,
                              static_cast<int>(s.ldb), &beta, c, CUDA_R_32F, static_cast<int>(s.ldc), compute,
                              CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

Status GemmStridedBatched(const CudaLayerContext& ctx, const GemmShape& s, float alpha, const void* a,
                          size_t stride_a, const void* b, size_t stride_b, cudaDataType_t ab, float beta,
                          float* c, size_t stride_c, size_t batch, cublasComputeType_t compute) {
  STRATA_RETURN_IF_ERROR(CheckShape(s));
  STRATA_RETURN_IF_ERROR(CheckInt("batch", batch));
  STRATA_RETURN_IF_ERROR(Bind(ctx));
  STRATA_BLAS_OK(
      "cublasGemmStridedBatchedEx",
      cublasGemmStridedBatchedEx(ctx.blas, s.op_a, s.op_b, static_cast<int>(s.m), static_cast<int>(s.n),
                                 static_cast<int>(s.k), &alpha, a, ab, static_cast<int>(s.lda),
                                 static_cast<long long>(stride_a), b, ab, static_cast<int>(s.ldb),
                                 static_cast<long long>(stride_b), &beta, c, CUDA_R_32F,
                                 static_cast<int>(s.ldc), static_cast<long long>(stride_c),
                                 static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

}  // namespace strata::layers::cuda_detail
