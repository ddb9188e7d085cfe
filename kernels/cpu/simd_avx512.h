// Internal: 16-lane loads, stores and conversions of the AVX-512 path. Include
// only from files built with -mavx512f -mavx512bw -mavx512vl -mavx512bf16;
// everything here has internal linkage. The AVX512-BF16 instruction is used
// only in instantiations with kBf16Insn, which dispatch picks only on CPUs
// that have it.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/range_kernels.h"

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kAvx512Lanes = 16;

inline __m256i LoadU16x16(const void* x, size_t i) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
}
inline void StoreU16x16(void* x, size_t i, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(x) + i), v);
}

template <DType D>
inline __m512 LoadAsF32x16(const void* x, size_t i) {
  if constexpr (D == DType::kF32) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  if constexpr (D == DType::kBF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(LoadU16x16(x, i)), 16));
  if constexpr (D == DType::kF16) return _mm512_cvtph_ps(LoadU16x16(x, i));
}

// Integer round to nearest even like base F32ToBF16: NaN -> (bits >> 16) | 0x40.
inline __m256i F32ToBF16x16Int(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// vcvtneps2bf16 rounds to nearest even and quiets NaN like the reference but
// treats subnormal inputs as zero; those (rare) lanes take the integer path.
inline __m256i F32ToBF16x16Insn(__m512 x) {
  const __m256i hw = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(
      _mm512_sub_epi32(abs, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x007fffff));
  if (subnormal == 0) return hw;
  return _mm256_mask_blend_epi16(subnormal, hw, F32ToBF16x16Int(x));
}

template <DType D, bool kBf16Insn>
inline void StoreFromF32x16(void* x, size_t i, __m512 v) {
  if constexpr (D == DType::kF32) _mm512_storeu_ps(static_cast<float*>(x) + i, v);
  if constexpr (D == DType::kBF16)
    StoreU16x16(x, i, kBf16Insn ? F32ToBF16x16Insn(v) : F32ToBF16x16Int(v));
  if constexpr (D == DType::kF16) StoreU16x16(x, i, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <CopyOut C, bool kBf16Insn>
inline void StoreCopyx16(void* copy, size_t i, __m512 p) {
  if constexpr (C == CopyOut::kBF16) StoreFromF32x16<DType::kBF16, kBf16Insn>(copy, i, p);
  if constexpr (C == CopyOut::kF16) StoreFromF32x16<DType::kF16, kBf16Insn>(copy, i, p);
}

}  // namespace
}  // namespace strata::kernels::internal
