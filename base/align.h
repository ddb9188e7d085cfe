// Alignment helpers for SIMD widths, O_DIRECT blocks and huge pages.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kHugePage = 2 * kMiB;
inline constexpr uint64_t kSimdBytes = 64;  // one AVX-512 register

constexpr bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
// REQUIRES: a is a power of two.
constexpr uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }
constexpr uint64_t AlignDown(uint64_t x, uint64_t a) { return x & ~(a - 1); }
constexpr bool IsAligned(uint64_t x, uint64_t a) { return (x & (a - 1)) == 0; }
inline bool IsAligned(const void* p, uint64_t a) {
  return IsAligned(reinterpret_cast<uintptr_t>(p), a);
}
// Rounds up to a multiple of m (any m > 0).
constexpr uint64_t RoundUpTo(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }
constexpr uint64_t Lcm(uint64_t a, uint64_t b) {
  uint64_t x = a, y = b;
  while (y) { uint64_t t = x % y; x = y; y = t; }
  return a / x * b;
}

}  // namespace strata
