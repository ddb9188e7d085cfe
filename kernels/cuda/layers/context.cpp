// The stream + cuBLAS owner and the device buffer.
#include "kernels/cuda/layers/context.h"

#include <string>

#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {

CudaLayerRuntime::~CudaLayerRuntime() {
  // Destructors cannot report: the results are dropped (a failed destroy at
  // exit leaves nothing behind that the process still uses).
  if (ctx_.blas != nullptr) cublasDestroy(ctx_.blas);
  if (ctx_.stream != nullptr) cudaStreamDestroy(ctx_.stream);
}

Status CudaLayerRuntime::Init() {
  if (ctx_.stream != nullptr) return StateError("CudaLayerRuntime::Init called twice");
  cudaStream_t stream = nullptr;
  STRATA_CUDA_OK("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ctx_.stream = stream;
  cublasHandle_t blas = nullptr;
  STRATA_BLAS_OK("cublasCreate", cublasCreate(&blas));
  ctx_.blas = blas;
  STRATA_BLAS_OK("cublasSetStream", cublasSetStream(ctx_.blas, ctx_.stream));
  return Status::Ok();
}

Status CudaLayerRuntime::Synchronize() const {
  STRATA_CUDA_OK("cudaStreamSynchronize", cudaStreamSynchronize(ctx_.stream));
  return Status::Ok();
}

CudaDeviceBuffer::~CudaDeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // see ~CudaLayerRuntime
}

Status CudaDeviceBuffer::Allocate(size_t bytes) {
  if (ptr_ != nullptr) {
    STRATA_CUDA_OK("cudaFree", cudaFree(ptr_));
    ptr_ = nullptr;
    bytes_ = 0;
  }
  if (bytes == 0) return Status::Ok();
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    ptr_ = nullptr;
    return cuda_detail::CudaStatus("cudaMalloc", e).WithContext(std::to_string(bytes) + " bytes");
  }
  bytes_ = bytes;
  return Status::Ok();
}

}  // namespace strata::layers
