// The SIMD path chosen without STRATA_CPU_ISA: the faster of AVX-512 and
// AVX2 on this CPU, by a short measurement at first use. Wider is not always
// faster (AVX-512 lowers some cores' clocks, and some cores split 512-bit
// operations in two): one review measured AVX2's Adam at 4.27 G params/s
// against AVX-512's 3.81 on the same machine. Every path gives bitwise the
// same results, so the choice moves time only, never numbers.
#include <algorithm>
#include <chrono>
#include <vector>

#include "kernels/cpu/adam.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {
namespace {

// Seconds of the fastest of `rounds` Adam steps over `n` elements on one
// thread's worth of work (a tile: ParallelForTiles runs it in place).
double FastestStep(CpuIsa isa, std::vector<float>& p, std::vector<float>& m, std::vector<float>& v,
                   const std::vector<float>& g, int rounds) {
  AdamOptions opt;
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!AdamStepOn(isa, opt, p.size(), p.data(), m.data(), v.data(), g.data(), nullptr).ok()) return 1e30;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  return best;
}

}  // namespace

CpuIsa MeasuredCpuIsa() {
  static const CpuIsa chosen = [] {
    if (!CpuSupports(CpuIsa::kAvx512)) return BestCpuIsa();
    // 16K elements (256 KiB over the four arrays: in L2, so the cores'
    // arithmetic is timed, not the memory both paths share), alternated,
    // the best of 7 rounds each: about a millisecond in all.
    constexpr size_t kN = 16384;
    std::vector<float> p(kN, 0.5f), m(kN, 0.0f), v(kN, 0.0f), g(kN);
    for (size_t i = 0; i < kN; ++i) g[i] = static_cast<float>(i % 97) * 1e-3f - 0.05f;
    double t512 = 1e30, t2 = 1e30;
    for (int r = 0; r < 3; ++r) {
      t512 = std::min(t512, FastestStep(CpuIsa::kAvx512, p, m, v, g, 7));
      t2 = std::min(t2, FastestStep(CpuIsa::kAvx2, p, m, v, g, 7));
    }
    return t512 <= t2 ? CpuIsa::kAvx512 : CpuIsa::kAvx2;
  }();
  return chosen;
}

}  // namespace strata::kernels
