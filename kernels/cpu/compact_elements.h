// Internal: the compact format element by element and block by block, the
// scalar reference of compact.h's definitions. Only for files built without
// ISA flags; the SIMD paths redo the same integer and IEEE operations in
// vectors, in the same order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/compact.h"
#include "kernels/cpu/compact_scale.h"

namespace strata::kernels::internal {
namespace {

inline constexpr uint32_t kAbsMask = 0x7fffffffu;
inline constexpr uint32_t kInfBits = 0x7f800000u;

struct SplitMaster {
  uint16_t hi;
  int8_t lo;
};

// w -> (bf16 round to nearest even, correction of the rest in 1/254 bf16 ULPs).
inline SplitMaster Split(float w) {
  const uint32_t bits = F32Bits(w);
  const uint16_t hi = F32ToBF16(w);
  if ((bits & kAbsMask) > kInfBits) return {hi, 0};  // NaN
  const int32_t d = static_cast<int32_t>(bits & kAbsMask) -
                    static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) & kAbsMask);
  const int32_t q = (d * 127 + 16384) >> 15;
  // A finite w that rounds to bf16 inf (d < 0) keeps a finite master.
  const bool over = (hi & 0x7fffu) == 0x7f80u && d < 0;
  return {hi, static_cast<int8_t>(over ? std::min(q, -1) : q)};
}

inline float Rebuild(uint16_t hi, int8_t lo) {
  const uint32_t h = static_cast<uint32_t>(hi) << 16;
  const int32_t d = (static_cast<int32_t>(lo) * 33026 + 64) >> 7;
  return BitsF32((h & ~kAbsMask) | static_cast<uint32_t>(static_cast<int32_t>(h & kAbsMask) + d));
}

// Largest |x| of a block as bits (integer max: exact, order-free; NaN wins).
inline uint32_t MaxAbsBits(const float* x, size_t len) {
  uint32_t mx = 0;
  for (size_t j = 0; j < len; ++j) mx = std::max(mx, F32Bits(x[j]) & kAbsMask);
  return mx;
}

// The code of y = |x|*k >= 0: sqrt(y) in fp32 (IEEE: correctly rounded on
// every path), rounded to the nearest integer (ties to even), capped.
inline int32_t CodeOf(float y, int32_t cap) {
  return std::min(static_cast<int32_t>(std::nearbyint(std::sqrt(y))), cap);
}

// m of one block -> codes and scale (compact.h).
inline float QuantizeM(const float* m, size_t len, int8_t* code) {
  const BlockScale sc = MBlockScale(MaxAbsBits(m, len));
  for (size_t j = 0; j < len; ++j) {
    const int32_t q = sc.live ? CodeOf(std::fabs(m[j]) * sc.k, 127) : 0;
    code[j] = static_cast<int8_t>(std::signbit(m[j]) ? -q : q);
  }
  return sc.stored;
}

// r = sqrt(v) of one block -> codes and scale.
inline float QuantizeV(const float* r, size_t len, uint8_t* code) {
  const BlockScale sc = VBlockScale(MaxAbsBits(r, len));
  for (size_t j = 0; j < len; ++j) code[j] = static_cast<uint8_t>(sc.live ? CodeOf(std::fabs(r[j]) * sc.k, 255) : 0);
  return sc.stored;
}

// A zero v code forces the m code to zero (compact.h).
inline void ZeroMWhereVZero(const uint8_t* v_code, int8_t* m_code, size_t len) {
  for (size_t j = 0; j < len; ++j)
    if (v_code[j] == 0) m_code[j] = 0;
}

inline float DequantizeM(int8_t q, float step) {
  const int32_t qi = q;
  return static_cast<float>(qi * (qi < 0 ? -qi : qi)) * step;
}
inline float DequantizeV(uint8_t q, float step) {
  const int32_t qi = q;
  const float t = static_cast<float>(qi * qi) * step;
  return t * t;
}
// Per-block dequantization steps from the stored scales.
inline float MStep(float scale) { return scale / kMCodeSquared; }
inline float VStep(float scale) { return scale / kVCodeSquared; }

}  // namespace
}  // namespace strata::kernels::internal
