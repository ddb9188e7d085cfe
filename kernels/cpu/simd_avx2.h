// Internal: 8-lane loads, stores and conversions of the AVX2 path. Include only
// from files built with -mavx2 -mfma -mf16c; everything here has internal
// linkage so that no AVX2 code can be shared with other paths.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/range_kernels.h"

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kAvx2Lanes = 8;

inline __m128i LoadU16x8(const void* x, size_t i) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
}
inline void StoreU16x8(void* x, size_t i, __m128i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(x) + i), v);
}

// Widening to f32 is exact for every dtype.
template <DType D>
inline __m256 LoadAsF32x8(const void* x, size_t i) {
  if constexpr (D == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  if constexpr (D == DType::kBF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LoadU16x8(x, i)), 16));
  if constexpr (D == DType::kF16) return _mm256_cvtph_ps(LoadU16x8(x, i));
}

// Round to nearest even like base F32ToBF16, result in the low half of each
// 32-bit lane: NaN -> (bits >> 16) | 0x40, everything else bits + 0x7fff + lsb.
inline __m256i F32ToBF16Lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(nan));
}

inline __m128i F32ToBF16x8(__m256 x) {
  const __m256i r = F32ToBF16Lanes(x);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Sixteen at once: one pack and one lane fix-up instead of two of each.
inline __m256i F32ToBF16x16(__m256 a, __m256 b) {
  const __m256i packed = _mm256_packus_epi32(F32ToBF16Lanes(a), F32ToBF16Lanes(b));
  return _mm256_permute4x64_epi64(packed, 0xd8);  // 128-bit lanes interleaved a, b
}

// F16C rounds to nearest even, overflows to inf, keeps subnormals and quiets
// NaN keeping the top payload bits: the same bits as base F32ToF16.
inline __m128i F32ToF16x8(__m256 x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }

template <DType D>
inline void StoreFromF32x8(void* x, size_t i, __m256 v) {
  if constexpr (D == DType::kF32) _mm256_storeu_ps(static_cast<float*>(x) + i, v);
  if constexpr (D == DType::kBF16) StoreU16x8(x, i, F32ToBF16x8(v));
  if constexpr (D == DType::kF16) StoreU16x8(x, i, F32ToF16x8(v));
}

template <CopyOut C>
inline void StoreCopyx8(void* copy, size_t i, __m256 p) {
  if constexpr (C == CopyOut::kBF16) StoreFromF32x8<DType::kBF16>(copy, i, p);
  if constexpr (C == CopyOut::kF16) StoreFromF32x8<DType::kF16>(copy, i, p);
}

template <CopyOut C>
inline void StoreCopyx16(void* copy, size_t i, __m256 a, __m256 b) {
  auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(copy) + i);
  if constexpr (C == CopyOut::kBF16) _mm256_storeu_si256(dst, F32ToBF16x16(a, b));
  if constexpr (C == CopyOut::kF16)
    _mm256_storeu_si256(dst, _mm256_set_m128i(F32ToF16x8(b), F32ToF16x8(a)));
}

}  // namespace
}  // namespace strata::kernels::internal
