// CUDA casts between f32, bf16 and f16, bitwise equal to base/dtype.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/device_elements.cuh"

namespace strata::kernels {

unsigned CudaGridFor(size_t n, int threads);  // adam.cu

namespace {

constexpr int kThreads = 256;

template <DType S, DType D>
__global__ void CastKernel(const void* __restrict__ src, void* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    cuda_detail::StoreFromF32<D>(dst, i, cuda_detail::LoadAsF32<S>(src, i));
}

using CastKernelFn = void (*)(const void*, void*, size_t);

template <DType S>
CastKernelFn PickDst(DType dst) {
  if (dst == DType::kBF16) return &CastKernel<S, DType::kBF16>;
  if (dst == DType::kF16) return &CastKernel<S, DType::kF16>;
  return &CastKernel<S, DType::kF32>;
}

CastKernelFn PickCast(DType src, DType dst) {
  if (src == DType::kBF16) return PickDst<DType::kBF16>(dst);
  if (src == DType::kF16) return PickDst<DType::kF16>(dst);
  return PickDst<DType::kF32>(dst);
}

}  // namespace

Status CastCuda(DType src_dtype, const void* src, DType dst_dtype, void* dst, size_t n,
                void* stream) {
  if (n == 0) return Status::Ok();
  if (!src || !dst) return InvalidError("CastCuda: null array");
  cuda_detail::ClearLastErrorBeforeLaunch();
  PickCast(src_dtype, dst_dtype)<<<CudaGridFor(n, kThreads), kThreads, 0,
                                   static_cast<cudaStream_t>(stream)>>>(src, dst, n);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return InternalError(std::string("CastCuda launch: ") + cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace strata::kernels
