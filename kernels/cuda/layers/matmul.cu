// Linear layers on cuBLAS. Row-major (R, K) is column-major K x R, so with
// W' = the column-major view of W (C x OC) and likewise inp' (C x N),
// dout' (OC x N):
//   out'     (OC x N) = W'ᵀ · inp'            out = inp · Wᵀ
//   dinp'    (C x N) += W' · dout'            dinp += dout · W
//   dweight' (C x OC) += inp' · dout'ᵀ        dweight += doutᵀ · inp
#include <string>

#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/column_grads.h"
#include "kernels/cuda/layers/gemm.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/matmul.h"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::GemmShape;
using cuda_detail::GlobalThread;
using cuda_detail::GridThreads;
using cuda_detail::kThreads;

// Scratch layout: [dout rounded to dtype (N·OC) | inp rounded (N·C) | column partials].
// The forward uses only the `inp` piece.
struct MatmulScratch {
  void* dout_lo = nullptr;
  void* inp_lo = nullptr;
  CudaScratch columns;
};

size_t CastBytes(size_t n, DType dtype) {
  return dtype == DType::kF32 ? 0 : AlignScratch(n * DTypeSize(dtype));
}

MatmulScratch CutScratch(CudaScratch s, size_t N, size_t C, size_t OC, DType dtype) {
  char* p = static_cast<char*>(s.ptr);
  MatmulScratch m;
  m.dout_lo = p;
  m.inp_lo = p + CastBytes(N * OC, dtype);
  const size_t used = CastBytes(N * OC, dtype) + CastBytes(N * C, dtype);
  m.columns = CudaScratch{p + used, s.bytes - used};
  return m;
}

Status CheckScratch(const char* fn, CudaScratch s, size_t N, size_t C, size_t OC, DType dtype) {
  if (s.bytes >= MatmulScratchBytes(N, C, OC, dtype)) return Status::Ok();
  return InvalidError(std::string(fn) + ": scratch of " + std::to_string(s.bytes) + " bytes, needs " +
                      std::to_string(MatmulScratchBytes(N, C, OC, dtype)));
}

// x (n fp32) as `dtype` into lo; returns what the GEMM should read: x itself for f32.
Result<const void*> Lower(const CudaLayerContext& ctx, const float* x, size_t n, DType dtype, void* lo) {
  if (dtype == DType::kF32) return static_cast<const void*>(x);
  STRATA_RETURN_IF_ERROR(kernels::CastCuda(DType::kF32, x, dtype, lo, n, ctx.stream));
  return static_cast<const void*>(lo);
}

__global__ void AddBiasKernel(float* out, const float* bias, size_t N, size_t OC) {
  for (size_t i = GlobalThread(); i < N * OC; i += GridThreads()) out[i] += bias[i % OC];
}

}  // namespace

size_t MatmulScratchBytes(size_t N, size_t C, size_t OC, DType dtype) {
  return CastBytes(N * OC, dtype) + CastBytes(N * C, dtype) + cuda_detail::ColumnGradScratchBytes(OC);
}

Status MatmulForwardCuda(const CudaLayerContext& ctx, float* out, const float* inp, const void* weight,
                         DType dtype, const float* bias, size_t N, size_t C, size_t OC, CudaScratch scratch) {
  STRATA_RETURN_IF_ERROR(CheckScratch("MatmulForwardCuda", scratch, N, C, OC, dtype));
  if (N == 0 || OC == 0) return Status::Ok();
  const MatmulScratch s = CutScratch(scratch, N, C, OC, dtype);
  STRATA_ASSIGN_OR_RETURN(const void* inp_g, Lower(ctx, inp, N * C, dtype, s.inp_lo));
  const GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, C, C, OC};
  STRATA_RETURN_IF_ERROR(cuda_detail::Gemm(ctx, shape, 1.0f, weight, inp_g, cuda_detail::CudaDataType(dtype),
                                           0.0f, out, CUBLAS_COMPUTE_32F));
  if (bias == nullptr) return Status::Ok();
  AddBiasKernel<<<BlocksFor(N * OC, kThreads), kThreads, 0, ctx.stream>>>(out, bias, N, OC);
  STRATA_LAUNCH_OK("AddBiasKernel");
  return Status::Ok();
}

Status MatmulBackwardCuda(const CudaLayerContext& ctx, float* dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, const void* weight, DType dtype, size_t N,
                          size_t C, size_t OC, CudaScratch scratch) {
  STRATA_RETURN_IF_ERROR(CheckScratch("MatmulBackwardCuda", scratch, N, C, OC, dtype));
  if (N == 0 || OC == 0 || C == 0) return Status::Ok();
  const MatmulScratch s = CutScratch(scratch, N, C, OC, dtype);
  const cudaDataType_t type = cuda_detail::CudaDataType(dtype);
  STRATA_ASSIGN_OR_RETURN(const void* dout_g, Lower(ctx, dout, N * OC, dtype, s.dout_lo));
  if (dinp != nullptr) {
    const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, C, OC, C};
    STRATA_RETURN_IF_ERROR(
        cuda_detail::Gemm(ctx, shape, 1.0f, weight, dout_g, type, 1.0f, dinp, CUBLAS_COMPUTE_32F));
  }
  STRATA_ASSIGN_OR_RETURN(const void* inp_g, Lower(ctx, inp, N * C, dtype, s.inp_lo));
  const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, C, OC, C};
  STRATA_RETURN_IF_ERROR(
      cuda_detail::Gemm(ctx, shape, 1.0f, inp_g, dout_g, type, 1.0f, dweight, CUBLAS_COMPUTE_32F));
  if (dbias == nullptr) return Status::Ok();
  return cuda_detail::ColumnGrads(ctx, nullptr, dbias, dout, nullptr, nullptr, nullptr, N, OC, s.columns);
}

}  // namespace strata::layers
