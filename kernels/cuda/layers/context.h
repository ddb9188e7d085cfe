// What every CUDA layer call takes: the stream its work is queued on, the
// caller's cuBLAS handle, and device scratch. Plus two owners for callers (the
// trainer, the tests): a stream with a cuBLAS handle, and a device allocation.
//
//   CudaLayerRuntime rt;
//   STRATA_RETURN_IF_ERROR(rt.Init());
//   STRATA_RETURN_IF_ERROR(LayerNormForwardCuda(rt.context(), out, mean, rstd, x, w, b, N, C));
//   STRATA_RETURN_IF_ERROR(rt.Synchronize());  // kernel faults surface here
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "base/status.h"

namespace strata::layers {

// Not owned. Every kernel, copy, memset and GEMM of a call is queued on
// `stream` in call order; a call returns after queuing (results are ready
// after a stream synchronisation). REQUIRES of `blas`: default math mode (no
// TF32 for fp32 GEMMs) and no concurrent use from another thread; each GEMM
// binds it to `stream` and to host pointer mode first.
struct CudaLayerContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
};

// Device memory a call may overwrite. Each call says how much it needs
// (...ScratchBytes) and refuses less with an InvalidError.
struct CudaScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Scratch sizes are rounded up to this, so that scratch cut into pieces keeps
// each piece aligned for vector loads and cuBLAS.
inline constexpr size_t kScratchAlign = 256;
inline size_t AlignScratch(size_t bytes) {
  return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// Owns a non-blocking stream and a cuBLAS handle on the current device.
// Non-blocking: the legacy default stream, which other code (cudaMemcpy) may
// use, does not serialise with it; copies into or out of buffers that the
// layers use go through this stream (or follow Synchronize()).
class CudaLayerRuntime {
 public:
  CudaLayerRuntime() = default;
  ~CudaLayerRuntime();
  CudaLayerRuntime(const CudaLayerRuntime&) = delete;
  CudaLayerRuntime& operator=(const CudaLayerRuntime&) = delete;

  Status Init();
  const CudaLayerContext& context() const { return ctx_; }
  // Waits for everything queued on the stream; a fault of any kernel queued
  // since the last synchronisation is returned here.
  Status Synchronize() const;

 private:
  CudaLayerContext ctx_;
};

// cudaMalloc'd memory, freed by the destructor (and by a second Allocate).
class CudaDeviceBuffer {
 public:
  CudaDeviceBuffer() = default;
  ~CudaDeviceBuffer();
  CudaDeviceBuffer(const CudaDeviceBuffer&) = delete;
  CudaDeviceBuffer& operator=(const CudaDeviceBuffer&) = delete;

  Status Allocate(size_t bytes);  // contents undefined; 0 bytes allocates nothing
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace strata::layers
