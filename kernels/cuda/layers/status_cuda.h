// Private to the CUDA layers: CUDA and cuBLAS results as Status. Every runtime
// call and every launch is checked; a kernel's own faults surface at the
// caller's next synchronisation (a stream sync or a copy back).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "base/status.h"

namespace strata::layers::cuda_detail {

inline Status CudaStatus(const char* op, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  // Returned as a Status: cleared, so that the next launch's check
  // (LaunchStatus reads the thread's last error) does not report it again.
  (void)cudaGetLastError();
  return Status(e == cudaErrorMemoryAllocation ? Code::kNoMem : Code::kInternal,
                std::string(op) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// After a <<<...>>> launch: a bad configuration (grid, block, shared memory)
// is reported here, at once.
inline Status LaunchStatus(const char* kernel) { return CudaStatus(kernel, cudaGetLastError()); }

inline Status BlasStatus(const char* op, cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return InternalError(std::string(op) + ": " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) +
                       ")");
}

}  // namespace strata::layers::cuda_detail

#define STRATA_CUDA_OK(op, call) STRATA_RETURN_IF_ERROR(::strata::layers::cuda_detail::CudaStatus(op, (call)))
#define STRATA_BLAS_OK(op, call) STRATA_RETURN_IF_ERROR(::strata::layers::cuda_detail::BlasStatus(op, (call)))
#define STRATA_LAUNCH_OK(kernel) STRATA_RETURN_IF_ERROR(::strata::layers::cuda_detail::LaunchStatus(kernel))
