// Element types of state (f32, bf16, f16) and their scalar conversions.
// The conversions here are the reference that every SIMD and CUDA cast is
// tested against: round to nearest even, NaN stays NaN, infinities kept.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "base/status.h"

namespace strata {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* DTypeName(DType t);  // "f32", "bf16", "f16"
Result<DType> ParseDType(std::string_view name);  // also "fp32", "float32", ...

inline uint32_t F32Bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float BitsF32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// f32 -> bf16, round to nearest even; NaN becomes a quiet NaN with the sign kept.
inline uint16_t F32ToBF16(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float BF16ToF32(uint16_t h) { return BitsF32(static_cast<uint32_t>(h) << 16); }

// f32 -> IEEE half, round to nearest even, overflow to infinity, subnormals kept.
uint16_t F32ToF16(float f);
float F16ToF32(uint16_t h);

}  // namespace strata
