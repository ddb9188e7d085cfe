// Shared by the CUDA layer tests: skip without a GPU (exit 77), device copies
// on the layers' stream, reproducible inputs, and the comparison
// ||gpu - cpu|| / ||cpu|| (fp64 norms over a whole tensor) against a tolerance.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/layers/convert.h"
#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/layers/context.h"

namespace strata::layers::cuda_test {

inline int g_failures = 0;

// Exits 77 (CTest's skip) with the reason when there is no usable GPU.
inline void SkipWithoutGpu() {
  const Result<int> gpus = kernels::CudaDeviceCount();
  if (gpus.ok() && gpus.value() > 0) return;
  std::printf("skipped: no GPU (%s)\n",
              gpus.ok() ? "cudaGetDeviceCount found 0 devices" : gpus.status().message().c_str());
  std::exit(77);
}

// A failed CUDA call or layer status ends the test: later results would be meaningless.
inline void Must(const Status& s, const char* what) {
  if (s.ok()) return;
  std::printf("FAIL %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}
inline void MustCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::printf("FAIL %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// A device copy of host data, and copies back; all on the layers' stream
// (non-blocking: a plain cudaMemcpy would not wait for it).
class Dev {
 public:
  template <typename T>
  Dev(const CudaLayerContext& ctx, const std::vector<T>& host) : ctx_(ctx) {
    Must(buf_.Allocate(host.size() * sizeof(T) + 1), "cudaMalloc");
    MustCuda(
        cudaMemcpyAsync(buf_.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, ctx.stream),
        "cudaMemcpyAsync H2D");
    MustCuda(cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize");  // host vectors may go away
  }
  float* f() const { return static_cast<float*>(buf_.get()); }
  int32_t* i() const { return static_cast<int32_t*>(buf_.get()); }
  void* v() const { return buf_.get(); }

 private:
  CudaLayerContext ctx_;
  CudaDeviceBuffer buf_;
};

inline std::vector<float> Get(const CudaLayerContext& ctx, const float* dev, size_t n) {
  std::vector<float> out(n);
  MustCuda(cudaMemcpyAsync(out.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost, ctx.stream),
           "cudaMemcpyAsync D2H");
  MustCuda(cudaStreamSynchronize(ctx.stream), "cudaStreamSynchronize (a kernel fault shows here)");
  return out;
}

// Uniform in [lo, hi) from a fixed LCG.
inline std::vector<float> Random(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = lo + (hi - lo) * static_cast<float>(static_cast<double>(s >> 11) / 9007199254740992.0);
  }
  return v;
}

inline std::vector<int32_t> RandomTokens(size_t n, int32_t V, uint64_t seed) {
  std::vector<int32_t> v(n);
  uint64_t s = seed * 2862933555777941757ull + 3037000493ull;
  for (auto& t : v) {
    s = s * 2862933555777941757ull + 3037000493ull;
    t = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(V));
  }
  return v;
}

// x rounded to `dtype` and back: values the GPU receives exactly.
inline std::vector<float> RoundTo(DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> lo(x.size() * DTypeSize(dtype));
  std::vector<float> out(x.size());
  FromF32(dtype, x.data(), lo.data(), x.size());
  ToF32(dtype, lo.data(), out.data(), x.size());
  return out;
}

// x in `dtype`, as bytes (what the engine's fetch hands the layers).
inline std::vector<uint8_t> AsDType(DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> lo(x.size() * DTypeSize(dtype));
  FromF32(dtype, x.data(), lo.data(), x.size());
  return lo;
}

// ||got - want|| / ||want||; fails when above tol, NaN, or when want is all
// zeros (the comparison would prove nothing).
inline double Compare(const std::string& what, const float* got, const float* want, size_t n, double tol) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  const double rel = norm > 0 ? std::sqrt(diff / norm) : NAN;
  const bool ok = rel <= tol;  // false for NaN
  if (!ok) ++g_failures;
  std::printf("%s %-44s rel err %.3e (tolerance %.0e)\n", ok ? "ok  " : "FAIL", what.c_str(), rel, tol);
  return rel;
}
inline double Compare(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                      double tol) {
  if (got.size() != want.size()) {
    ++g_failures;
    std::printf("FAIL %s: %zu values vs %zu\n", what.c_str(), got.size(), want.size());
    return NAN;
  }
  return Compare(what, got.data(), want.data(), want.size(), tol);
}

inline bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void ExpectBitwise(const std::string& what, const std::vector<float>& a, const std::vector<float>& b) {
  const bool ok = Bitwise(a, b);
  if (!ok) ++g_failures;
  std::printf("%s %-44s bitwise\n", ok ? "ok  " : "FAIL", what.c_str());
}

inline int Finish() {
  std::printf("%s: %d failures\n", g_failures ? "FAIL" : "ok", g_failures);
  return g_failures ? 1 : 0;
}

}  // namespace strata::layers::cuda_test
