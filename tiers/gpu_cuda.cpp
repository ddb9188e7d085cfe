// gpu.h on the CUDA runtime. Every result is checked and named.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <fstream>

#include "tiers/gpu.h"

namespace strata::gpu {

// cudaGetLastError reports the calling thread's last error of any call, and
// the kernels' launch checks read it: an error already turned into a Status
// here is cleared, so that a later launch does not report it as its own.
static Status CudaError(const char* call, cudaError_t e) {
  (void)cudaGetLastError();
  return Status(e == cudaErrorMemoryAllocation ? Code::kNoMem : Code::kInternal,
                std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define STRATA_CUDA_RETURN(call)                             \
  do {                                                       \
    cudaError_t e_ = (call);                                 \
    if (e_ != cudaSuccess) return CudaError(#call, e_);      \
  } while (0)

// Asked once a process (a function-local static: thread-safe, as
// strata_engine_create, which reaches it, is documented to be).
int DeviceCount(std::string* why) {
  struct Probe {
    int count = 0;
    std::string reason;
  };
  static const Probe probe = [] {
    Probe p;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      p.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
      n = 0;
      cudaGetLastError();  // clear the sticky error
    } else if (n == 0) {
      p.reason = "no CUDA device";
    }
    p.count = n;
    return p;
  }();
  if (why) *why = probe.reason;
  return probe.count;
}
bool Available() { return DeviceCount() > 0; }
uint64_t DeviceMemoryBytes(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return 0;
  return prop.totalGlobalMem;
}
std::string DeviceName(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  return prop.name;
}
Status SetDevice(int device) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return CudaError("cudaSetDevice", e).WithContext("GPU " + std::to_string(device));
  return Status::Ok();
}

Result<void*> Malloc(uint64_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) return CudaError("cudaMalloc", e).WithContext(std::to_string(bytes) + " bytes");
  return p;
}
Status Free(void* p) { STRATA_CUDA_RETURN(cudaFree(p)); return Status::Ok(); }
Status HostRegister(void* p, uint64_t bytes) {
  STRATA_CUDA_RETURN(cudaHostRegister(p, bytes, cudaHostRegisterDefault));
  return Status::Ok();
}
Status HostUnregister(void* p) { STRATA_CUDA_RETURN(cudaHostUnregister(p)); return Status::Ok(); }

int NumaNodeOfDevice(int device) {
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) return -1;
  std::string id(bus);
  for (auto& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::ifstream f("/sys/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (f >> node) return node;
  return -1;
}

Result<Stream> StreamCreate() {
  cudaStream_t s;
  STRATA_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return static_cast<Stream>(s);
}
Status StreamDestroy(Stream s) {
  STRATA_CUDA_RETURN(cudaStreamDestroy(static_cast<cudaStream_t>(s)));
  return Status::Ok();
}
Status MemcpyAsync(void* dst, const void* src, uint64_t bytes, bool to_device, Stream s) {
  STRATA_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes,
                                     to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                     static_cast<cudaStream_t>(s)));
  return Status::Ok();
}
Status StreamSynchronize(Stream s) {
  STRATA_CUDA_RETURN(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
  return Status::Ok();
}
Result<Event> EventRecord(Stream s) {
  cudaEvent_t e;
  STRATA_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(s));
  if (r != cudaSuccess) {
    cudaEventDestroy(e);
    return CudaError("cudaEventRecord", r);
  }
  return static_cast<Event>(e);
}
Status EventSynchronize(Event ev) {
  auto e = static_cast<cudaEvent_t>(ev);
  cudaError_t r = cudaEventSynchronize(e);
  cudaEventDestroy(e);
  if (r != cudaSuccess) return CudaError("cudaEventSynchronize", r);
  return Status::Ok();
}
bool EventQuery(Event ev) {
  if (cudaEventQuery(static_cast<cudaEvent_t>(ev)) != cudaErrorNotReady) return true;  // an error: the wait names it
  (void)cudaGetLastError();  // "not ready" is no error, but it is left as the thread's last one
  return false;
}

}  // namespace strata::gpu
