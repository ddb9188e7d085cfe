// DType names and the scalar half-precision conversions.
#include "base/dtype.h"

namespace strata {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32" || name == "float") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "fp16" || name == "float16" || name == "half") return DType::kF16;
  return InvalidError("dtype '" + std::string(name) + "' is not one of f32, bf16, f16");
}

uint16_t F32ToF16(float f) {
  const uint32_t u = F32Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {  // below 2^-14: subnormal half or zero
    // Scale so that the half's subnormal ulp (2^-24) becomes 1.0, then let
    // the FPU round to nearest even by adding a magic number.
    const float magic = BitsF32(0x4b000000u);  // 2^23: ulp of 1.0 at this exponent
    const float scaled = BitsF32(abs) * BitsF32(0x4b800000u) /* 2^24 */;
    const float r = scaled + magic;
    return sign | static_cast<uint16_t>(F32Bits(r) - 0x4b000000u);
  }
  // Normal: rebias exponent (127 -> 15) and round mantissa 23 -> 10 bits.
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  m -= (127u - 15u) << 23;
  return sign | static_cast<uint16_t>(m >> 13);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  // Inf; a NaN keeps its sign and payload and is quieted (bit 22), as the
  // F16C and AVX-512 conversions (vcvtph2ps) do: a signalling f16 NaN
  // widened on every ISA gives the same bits.
  if (exp == 0x1f) return BitsF32(sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u));
  if (exp != 0) return BitsF32(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return BitsF32(sign);
  // Subnormal: value = man * 2^-24.
  const float v = static_cast<float>(man) * BitsF32(0x33800000u);
  return BitsF32(sign | F32Bits(v));
}

}  // namespace strata
