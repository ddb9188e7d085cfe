// ReduceMemory on a GPU (CUDA builds): the caller's gradients are cast into
// the packed buffer on the device, on the legacy default stream, which the
// NCCL communicator's stream waits for; the reduced sums come back to the
// host through the given stream. Every CUDA result is checked and named.
#include <cuda_runtime_api.h>

#include <string>

#include "engine/reduce/grad_reduce.h"
#include "kernels/cuda/adam_cuda.h"

namespace strata {
namespace {

Status Cuda(const char* call, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

class DeviceReduceMemory final : public ReduceMemory {
 public:
  explicit DeviceReduceMemory(cudaStream_t stream) : stream_(stream) {}
  bool on_device() const override { return true; }
  Status Cast(DType dtype, const void* src, float* dst, uint64_t n) override {
    if (dtype == DType::kF32)
      return Cuda("cudaMemcpyAsync (gradients, device to device)",
                  cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, nullptr));
    return kernels::CastCuda(dtype, src, DType::kF32, dst, n, nullptr);
  }
  Status Zero(float* dst, uint64_t n) override {
    return Cuda("cudaMemsetAsync (gradient padding)", cudaMemsetAsync(dst, 0, n * 4, nullptr));
  }
  Status Sync() override { return Cuda("cudaStreamSynchronize (packed gradients)", cudaStreamSynchronize(nullptr)); }
  Status ToHost(float* host_dst, const float* src, uint64_t n) override {
    STRATA_RETURN_IF_ERROR(Cuda("cudaMemcpyAsync (reduced gradients, device to host)",
                                cudaMemcpyAsync(host_dst, src, n * 4, cudaMemcpyDeviceToHost, stream_)));
    return Cuda("cudaStreamSynchronize (reduced gradients)", cudaStreamSynchronize(stream_));
  }

 private:
  cudaStream_t stream_;  // null: the legacy default stream
};

}  // namespace

std::unique_ptr<ReduceMemory> MakeDeviceReduceMemory(void* stream) {
  return std::make_unique<DeviceReduceMemory>(static_cast<cudaStream_t>(stream));
}

}  // namespace strata
