// What the CUDA kernel tests share: a failure count, a check that counts,
// CUDA calls that stop the test when they fail, and a device buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace strata::kernels::test {

inline int g_failures = 0;

#define CHECK_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) {                                                                 \
      std::printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// Counts a failure (printing the first 20); returns `ok`.
inline bool Expect(bool ok, const std::string& what) {
  if (ok) return true;
  ++g_failures;
  if (g_failures < 20) std::printf("FAIL %s\n", what.c_str());
  return false;
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) : bytes(bytes) { CHECK_CUDA(cudaMalloc(&ptr, bytes ? bytes : 1)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Put(const void* host) { CHECK_CUDA(cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice)); }
  void Get(void* host) const { CHECK_CUDA(cudaMemcpy(host, ptr, bytes, cudaMemcpyDeviceToHost)); }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
  void* ptr = nullptr;
  size_t bytes;
};

}  // namespace strata::kernels::test
