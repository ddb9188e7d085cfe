// Helpers of the kernel tests: deterministic data, misaligned buffers, the
// bitwise comparison (NaN equals NaN) and the list of SIMD paths to try.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels::test {

// xorshift64*: fast and the same on every machine.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return s_ * 0x2545F4914F6CDD1Dull;
  }
  // Uniform in [-1, 1) times 2^k with k uniform in [-4, 4]: several binades.
  float Spread() {
    const float u = static_cast<float>(static_cast<int64_t>(Next() >> 40) - (1 << 23)) /
                    static_cast<float>(1 << 23);
    return std::ldexp(u, static_cast<int>(Next() % 9) - 4);
  }

 private:
  uint64_t s_;
};

// n elements of `bytes` each starting `offset` elements into a 64-byte
// aligned allocation, so tests can start arrays at any misalignment.
class Buffer {
 public:
  Buffer(size_t n, size_t bytes, size_t offset)
      : storage_((n + offset) * bytes + 128), bytes_(bytes) {
    uintptr_t p = reinterpret_cast<uintptr_t>(storage_.data());
    p = (p + 63) & ~uintptr_t{63};
    data_ = reinterpret_cast<uint8_t*>(p) + offset * bytes;
  }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(data_); }
  void* data() { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> storage_;
  uint8_t* data_;
  size_t bytes_;
};

inline bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || F32Bits(a) == F32Bits(b);
}

// Index of the first element that differs (NaN == NaN), or -1.
inline long FirstDiff(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!SameFloat(a[i], b[i])) return static_cast<long>(i);
  return -1;
}

// Stores f as `dtype` at element i of x (the test's way to make gradients).
inline void StoreAs(DType dtype, void* x, size_t i, float f) {
  if (dtype == DType::kF32) static_cast<float*>(x)[i] = f;
  if (dtype == DType::kBF16) static_cast<uint16_t*>(x)[i] = F32ToBF16(f);
  if (dtype == DType::kF16) static_cast<uint16_t*>(x)[i] = F32ToF16(f);
}

// The SIMD paths this CPU runs; prints a skip line for each one it lacks.
// STRATA_EXHAUSTIVE=1: sweeps run over every bit pattern (minutes per SIMD
// path; the ctest label `exhaustive`, which the default run leaves out).
// Otherwise they take a sample that still reaches every path, every exponent,
// the rounding boundaries and the tails.
inline bool Exhaustive() {
  const char* e = std::getenv("STRATA_EXHAUSTIVE");
  return e != nullptr && std::string(e) == "1";
}

inline std::vector<CpuIsa> SimdPathsHere() {
  std::vector<CpuIsa> paths;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) {
      paths.push_back(isa);
    } else {
      std::printf("skipped: CPU lacks %s (path %s not tested here)\n",
                  isa == CpuIsa::kAvx512 ? "AVX-512" : "AVX2+FMA+F16C", CpuIsaName(isa));
    }
  }
  return paths;
}

// main() of the path tests: exit 77 when no SIMD path can run at all.
inline int RunPathTests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (SimdPathsHere().empty()) {
    std::printf("skipped: CPU has no SIMD path to compare with the scalar reference\n");
    return 77;
  }
  return RUN_ALL_TESTS();
}

}  // namespace strata::kernels::test
