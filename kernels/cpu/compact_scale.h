// Internal: a compact block's scale from its largest magnitude, the one
// decision every path makes (compact.h): which blocks are live, the scale
// stored for each, and the factor that turns a magnitude into a squared code.
// Integer compares and one IEEE division, so it is safe in files built with
// ISA flags (no FMA to contract, nothing a flag changes); internal linkage, so
// no such file can lend its copy to a scalar caller.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/compact.h"

namespace strata::kernels::internal {
namespace {

inline constexpr uint32_t kScaleInfBits = 0x7f800000u;
inline constexpr uint32_t kScaleNaNBits = 0x7fc00000u;
inline constexpr float kMCodeSquared = 16129.0f;  // 127^2
inline constexpr float kVCodeSquared = 65025.0f;  // 255^2

struct BlockScale {
  float stored;  // live: the maximum; finite but dead: 0; not finite: NaN
  float k;       // live: code^2 per unit of magnitude; dead: 0
  bool live;
};

inline BlockScale ScaleOf(uint32_t max_bits, bool live, float code_squared) {
  const float x = BitsF32(max_bits);
  if (live) return {x, code_squared / x, true};
  return {max_bits < kScaleInfBits ? 0.0f : BitsF32(kScaleNaNBits), 0.0f, false};
}

// m's block: live when its largest |m| is finite and at least kCompactMinScale.
inline BlockScale MBlockScale(uint32_t amax_bits) {
  return ScaleOf(amax_bits, amax_bits < kScaleInfBits && BitsF32(amax_bits) >= kCompactMinScale,
                 kMCodeSquared);
}

// r = sqrt(v) as quantized: +inf (v overflowed from a finite gradient) is
// the largest float, so that the block stays live rather than NaN (compact.h);
// NaN stays NaN. Every path quantizes SaturateRoot(r), the update uses r.
inline float SaturateRoot(float r) { return F32Bits(r) == kScaleInfBits ? BitsF32(0x7f7fffffu) : r; }

// v's block, by r = sqrt(v): live when its largest r is finite and above 0.
inline BlockScale VBlockScale(uint32_t rmax_bits) {
  return ScaleOf(rmax_bits, rmax_bits < kScaleInfBits && BitsF32(rmax_bits) > 0.0f, kVCodeSquared);
}

}  // namespace
}  // namespace strata::kernels::internal
