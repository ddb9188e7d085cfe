// Device loads, stores and conversions shared by the CUDA kernels; bit for bit
// the reference conversions of base/dtype.h (round to nearest even, NaN kept).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "base/dtype.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::cuda_detail {

// Before a <<<...>>> launch whose check reads cudaGetLastError, which reports
// the thread's last error of any call: clears what an earlier call left
// there (a stream or event query's "not ready", an error already returned as
// a Status), so that the check after the launch reports the launch's own.
inline void ClearLastErrorBeforeLaunch() { (void)cudaGetLastError(); }

// IEEE half -> f32 in integer arithmetic, as base F16ToF32: every NaN keeps
// its sign and payload and is quieted (bit 22), as x86's vcvtph2ps does.
// (__half2float, cvt.f32.f16, returns the canonical NaN for every NaN input,
// which made the f16 casts differ from the CPU's on the 2046 NaN patterns.)
__device__ __forceinline__ float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u));
  if (exp != 0) return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return __uint_as_float(sign);
  // Subnormal: man * 2^-24, exact in f32.
  return __uint_as_float(sign | __float_as_uint(__uint2float_rn(man) * __uint_as_float(0x33800000u)));
}

template <DType D>
__device__ __forceinline__ float LoadAsF32(const void* x, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (D == DType::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  } else {
    return F16BitsToF32(static_cast<const uint16_t*>(x)[i]);
  }
}

__device__ __forceinline__ uint16_t ToBF16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ uint16_t ToF16(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)  // NaN: quiet, top payload bits kept, as base F32ToF16
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((abs >> 13) & 0x3ffu));
  return __half_as_ushort(__float2half_rn(f));
}

template <DType D>
__device__ __forceinline__ void StoreFromF32(void* x, size_t i, float f) {
  if constexpr (D == DType::kF32) {
    static_cast<float*>(x)[i] = f;
  } else if constexpr (D == DType::kBF16) {
    static_cast<uint16_t*>(x)[i] = ToBF16(f);
  } else {
    static_cast<uint16_t*>(x)[i] = ToF16(f);
  }
}

// Adam's new first moment from the old one and the gradient, as the CPU's
// FirstMoment (kernels/cpu/scalar_elements.h, step_scalars.h), rounding for rounding.
template <bool kLerp>
__device__ __forceinline__ float FirstMoment(const AdamStepScalars& s, float m, float g) {
  if constexpr (kLerp) return __fmaf_rn(s.lerp_weight, __fsub_rn(g, m), s.lerp_from_grad ? g : m);
  return __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(m, s.beta1));
}

}  // namespace strata::kernels::cuda_detail
