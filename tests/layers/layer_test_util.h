// Shared helpers of the layer tests: reproducible inputs and a finite-difference
// gradient check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace strata::layers::test {

// Uniform values in [lo, hi) from a fixed LCG, rounded to multiples of 2^-12 so
// that x ± h and x ± 2h with h = 2^-7 are exact in fp32 (|x| < 2^11): the
// finite-difference steps are then exactly symmetric.
inline std::vector<float> Random(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(s >> 11) / 9007199254740992.0;  // [0, 1)
    x = static_cast<float>(std::round((lo + (hi - lo) * u) * 4096.0) / 4096.0);
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

// Σ r·y in fp64: the scalar loss whose gradient w.r.t. y is r.
inline double Dot(const std::vector<float>& r, const float* y) {
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += static_cast<double>(r[i]) * y[i];
  return s;
}

// Finite-difference step: a power of two (exact steps, see Random).
inline constexpr float kStep = 1.0f / 128;

// Compares grad[i] with the 4-point central difference
//   (8·(L(x+h) - L(x-h)) - (L(x+2h) - L(x-2h))) / 12h,
// whose truncation error is h⁴/30·L⁽⁵⁾ ≈ 1e-10·L⁽⁵⁾: negligible. What remains is
// fp32 rounding in the kernel's outputs that x[i] changes (the others are
// computed bitwise the same and cancel; L is summed in fp64): about
// 6e-8·sqrt(k)·|r·y| / h ≈ 1e-4 for the k ≲ 100 outputs touched here, plus the
// analytic gradient's own fp32 error. `atol` and `rtol` sit 5x or more above the
// errors measured (printed on failure). Checks every `stride`-th element.
inline void CheckGradient(const std::string& what, std::vector<float>& x, const float* grad,
                          const std::function<double()>& loss, double atol, double rtol, size_t stride = 1) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); i += stride) {
    const float x0 = x[i];
    auto at = [&](float k) {
      x[i] = x0 + k * kStep;
      return loss();
    };
    const double fd = (8.0 * (at(1) - at(-1)) - (at(2) - at(-2))) / (12.0 * kStep);
    x[i] = x0;
    const double err = std::fabs(fd - grad[i]);
    worst = std::max(worst, err / (atol + rtol * std::fabs(fd)));
    ASSERT_LE(err, atol + rtol * std::fabs(fd))
        << what << "[" << i << "]: analytic " << grad[i] << " vs finite difference " << fd;
  }
  std::printf("%-28s worst |error| / tolerance = %.3f\n", what.c_str(), worst);
}

}  // namespace strata::layers::test
