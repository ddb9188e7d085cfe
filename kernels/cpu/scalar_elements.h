// Internal: element loads and stores of the scalar reference paths, on top of
// base/dtype.h's reference conversions. Only for files built without ISA flags.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/range_kernels.h"

namespace strata::kernels::internal {
namespace {

template <DType G>
inline float LoadAsF32(const void* x, size_t i) {
  if constexpr (G == DType::kF32) return static_cast<const float*>(x)[i];
  if constexpr (G == DType::kBF16) return BF16ToF32(static_cast<const uint16_t*>(x)[i]);
  if constexpr (G == DType::kF16) return F16ToF32(static_cast<const uint16_t*>(x)[i]);
}

template <DType D>
inline void StoreFromF32(void* x, size_t i, float f) {
  if constexpr (D == DType::kF32) static_cast<float*>(x)[i] = f;
  if constexpr (D == DType::kBF16) static_cast<uint16_t*>(x)[i] = F32ToBF16(f);
  if constexpr (D == DType::kF16) static_cast<uint16_t*>(x)[i] = F32ToF16(f);
}

template <CopyOut C>
inline void StoreCopy(void* copy, size_t i, float p) {
  if constexpr (C == CopyOut::kBF16) StoreFromF32<DType::kBF16>(copy, i, p);
  if constexpr (C == CopyOut::kF16) StoreFromF32<DType::kF16>(copy, i, p);
}

// Adam's new first moment from the old one and the gradient (step_scalars.h).
template <bool kLerp>
inline float FirstMoment(const AdamStepScalars& s, float m, float g) {
  if constexpr (kLerp) return std::fma(s.lerp_weight, g - m, s.lerp_from_grad ? g : m);
  return std::fma(s.one_minus_beta1, g, m * s.beta1);
}

}  // namespace
}  // namespace strata::kernels::internal
