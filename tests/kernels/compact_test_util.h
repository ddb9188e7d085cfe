// Helpers of the compact-state tests: the five arrays of n elements at chosen
// misalignments, copies and bitwise comparison of two states.
#pragma once

#include <cstring>
#include <string>

#include "kernels/cpu/compact.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {

// The compact step's SIMD paths to compare here. Its AVX-512 twin has not
// yet run on hardware, so CompactAdamStep does not choose it, and it is
// tested only when STRATA_TEST_UNVERIFIED_AVX512=1 (tools/gpu-check.sh sets
// it on the device machine): a first run on an AVX-512 CI machine must not
// turn the suite red for code no caller reaches.
inline std::vector<CpuIsa> CompactSimdPaths() {
  std::vector<CpuIsa> paths = SimdPathsHere();
  const char* e = std::getenv("STRATA_TEST_UNVERIFIED_AVX512");
  if (e != nullptr && std::string(e) == "1") return paths;
  std::vector<CpuIsa> out;
  for (CpuIsa isa : paths) {
    if (isa == CpuIsa::kAvx512)
      std::printf("skipped: the compact AVX-512 path (not yet run on hardware; STRATA_TEST_UNVERIFIED_AVX512=1 "
                  "tests it)\n");
    else
      out.push_back(isa);
  }
  return out;
}

class CompactBuffers {
 public:
  CompactBuffers(size_t n, size_t offset)
      : n_(n),
        hi_(n, 2, offset % 16),
        lo_(n, 1, (offset + 1) % 16),
        mq_(n, 1, (offset + 2) % 16),
        ms_(CompactScaleCount(n), 4, (offset + 3) % 16),
        vq_(n, 1, (offset + 4) % 16),
        vs_(CompactScaleCount(n), 4, (offset + 5) % 16) {}
  CompactState state() {
    return {hi_.as<uint16_t>(), lo_.as<int8_t>(),  mq_.as<int8_t>(),
            ms_.as<float>(),    vq_.as<uint8_t>(), vs_.as<float>()};
  }
  size_t n() const { return n_; }
  void CopyFrom(CompactBuffers& o) {
    CompactState a = state(), b = o.state();
    const size_t nb = CompactScaleCount(n_);
    std::memcpy(a.w_hi, b.w_hi, 2 * n_);
    std::memcpy(a.w_lo, b.w_lo, n_);
    std::memcpy(a.m_code, b.m_code, n_);
    std::memcpy(a.v_code, b.v_code, n_);
    std::memcpy(a.m_scale, b.m_scale, 4 * nb);
    std::memcpy(a.v_scale, b.v_scale, 4 * nb);
  }

 private:
  size_t n_;
  Buffer hi_, lo_, mq_, ms_, vq_, vs_;
};

// Empty when a and b hold the same bits (scales: NaN equals NaN), else which
// array and element first differ.
inline std::string CompactDiff(CompactBuffers& x, CompactBuffers& y) {
  const CompactState a = x.state(), b = y.state();
  const size_t n = x.n(), nb = CompactScaleCount(n);
  for (size_t i = 0; i < n; ++i) {
    if (a.w_hi[i] != b.w_hi[i]) return "w_hi[" + std::to_string(i) + "]";
    if (a.w_lo[i] != b.w_lo[i]) return "w_lo[" + std::to_string(i) + "]";
    if (a.m_code[i] != b.m_code[i]) return "m_code[" + std::to_string(i) + "]";
    if (a.v_code[i] != b.v_code[i]) return "v_code[" + std::to_string(i) + "]";
  }
  const long m = FirstDiff(a.m_scale, b.m_scale, nb), v = FirstDiff(a.v_scale, b.v_scale, nb);
  if (m >= 0) return "m_scale[" + std::to_string(m) + "]";
  if (v >= 0) return "v_scale[" + std::to_string(v) + "]";
  return "";
}

}  // namespace strata::kernels::test
