// AVX-512 path of the compact Adam/AdamW step: a block of 32 elements is two
// vectors of 16; the scalar reference's integer and IEEE operations in the
// same order (the update is adam_avx512.cpp's), so results are bitwise equal.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/compact_scale.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx512.h"
#include "kernels/cpu/compact_tail.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/simd_avx512.h"

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kVectors = kCompactBlock / kAvx512Lanes;  // 2

inline __m512i Set1(int32_t x) { return _mm512_set1_epi32(x); }

inline __m128i Load16Bytes(const void* x) { return _mm_loadu_si128(static_cast<const __m128i*>(x)); }

// Rebuild in compact_elements.h: hi's sign, and the signed magnitude
// difference added to hi's magnitude (as compact_avx2.cpp).
inline __m512 Rebuild(const uint16_t* hi, const int8_t* lo) {
  const __m512i h =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi))), 16);
  const __m512i q = _mm512_cvtepi8_epi32(Load16Bytes(lo));
  const __m512i d = _mm512_srai_epi32(_mm512_add_epi32(_mm512_mullo_epi32(q, Set1(33026)), Set1(64)), 7);
  const __m512i abs = Set1(0x7fffffff);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(abs, h), _mm512_add_epi32(_mm512_and_si512(h, abs), d)));
}

// Split in compact_elements.h, as compact_avx2.cpp: bf16 (base F32ToBF16's
// integer rounding) in the low halves of the lanes, and the corrections.
inline void Split(__m512 p, __m512i* hi, __m512i* lo) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, Set1(1)), Set1(0x7fff));
  const __m512i hb = _mm512_and_si512(_mm512_add_epi32(u, bias), Set1(static_cast<int32_t>(0xffff0000u)));
  const __m512i abs = _mm512_and_si512(u, Set1(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, Set1(0x7f800000));
  *hi = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(hb, 16), _mm512_or_si512(high, Set1(0x40)));
  const __m512i d = _mm512_sub_epi32(u, hb);
  __m512i q =
      _mm512_srai_epi32(_mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(d, 7), d), Set1(16384)), 15);
  const __mmask16 top = _mm512_cmpgt_epi32_mask(abs, Set1(0x7f7fff7e));  // top 129 floats, inf, NaN
  const __mmask16 nonfinite = _mm512_cmpgt_epi32_mask(abs, Set1(0x7f7fffff));
  q = _mm512_mask_sub_epi32(q, top, q, Set1(1));
  *lo = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nonfinite), q);
}

inline __m512 DequantizeM(const int8_t* code, __m512 step) {
  const __m512i q = _mm512_cvtepi8_epi32(Load16Bytes(code));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(q, _mm512_abs_epi32(q))), step);
}
inline __m512 DequantizeV(const uint8_t* code, __m512 step) {
  const __m512i q = _mm512_cvtepu8_epi32(Load16Bytes(code));
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(q, q)), step);
  return _mm512_mul_ps(t, t);
}

// Largest |x| bits over the block's two vectors (integer max, as MaxAbsBits).
inline uint32_t MaxAbsBits(const __m512* x) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(x[0]), Set1(0x7fffffff));
  const __m512i b = _mm512_and_si512(_mm512_castps_si512(x[1]), Set1(0x7fffffff));
  return static_cast<uint32_t>(_mm512_reduce_max_epi32(_mm512_max_epi32(a, b)));
}

// Codes of a live block (CodeOf in compact_elements.h): rint(sqrt(|x|*k)),
// capped; vsqrtps is correctly rounded and vcvtps2dq rounds to nearest even.
// (The divider then serves three square roots and a division per vector:
// about 46 cycles per 16 elements on Skylake-SP, near this step's memory
// bound there; an exact code from a Newton guess would spare it for ~17
// more instructions a vector.)
inline __m512i Codes(__m512 x, __m512 k, int32_t cap) {
  const __m512 y =
      _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), Set1(0x7fffffff))), k);
  return _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_sqrt_ps(y)), Set1(cap));
}

inline void Store16Bytes(void* dst, __m512i q) {
  _mm_storeu_si128(static_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q));
}

// The block's new moments -> scales (compact_scale.h) and codes (QuantizeM,
// QuantizeV, ZeroMWhereVZero in compact_elements.h). r == nullptr: Lion, m
// only (no v, so no zero-v rule).
inline void StoreMoments(const CompactState& s, size_t i, const __m512 (&m)[kVectors], const __m512* r) {
  const size_t b = i / kCompactBlock;
  const BlockScale ms = MBlockScale(MaxAbsBits(m));
  s.m_scale[b] = ms.stored;
  BlockScale vs{};
  if (r != nullptr) {
    vs = VBlockScale(MaxAbsBits(r));
    s.v_scale[b] = vs.stored;
  }
  const __m512 km = _mm512_set1_ps(ms.k), kv = _mm512_set1_ps(vs.k);
#pragma GCC unroll 4
  for (size_t k = 0; k < kVectors; ++k) {
    __m512i qm = _mm512_setzero_si512();
    if (ms.live) {
      qm = Codes(m[k], km, 127);
      const __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(m[k]), _mm512_setzero_si512());
      qm = _mm512_mask_sub_epi32(qm, neg, _mm512_setzero_si512(), qm);
    }
    if (r != nullptr) {
      const __m512i qv = vs.live ? Codes(r[k], kv, 255) : _mm512_setzero_si512();
      qm = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(qv, qv), qm);
      Store16Bytes(s.v_code + i + k * kAvx512Lanes, qv);
    }
    Store16Bytes(s.m_code + i + k * kAvx512Lanes, qm);
  }
}

template <CompactCopy C>
inline void StoreCopy(void* copy, size_t i, __m512 p) {
  if constexpr (C == CompactCopy::kF16) StoreU16x16(copy, i, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
  if constexpr (C == CompactCopy::kF32) _mm512_storeu_ps(static_cast<float*>(copy) + i, p);
}

template <DType G, CompactCopy C, bool kL2, bool kLerp>
struct CompactAdamAvx512 {
  // AdamAvx512::Block's update of 16 elements at e on dequantized state;
  // returns the new param and sets *m, *r = new m, sqrt(new v).
  static __m512 Update(const AdamConstsx16& k, const CompactArrays& a, size_t e, __m512 m_step, __m512 v_step,
                       __m512* m_out, __m512* r_out) {
    __m512 g = _mm512_mul_ps(LoadAsF32x16<G>(a.grad, e), k.grad_scale);
    __m512 p = Rebuild(a.s.w_hi + e, a.s.w_lo + e);
    if constexpr (kL2) g = _mm512_fmadd_ps(p, k.l2, g);
    p = _mm512_mul_ps(p, k.decay);
    const __m512 m = FirstMoment<kLerp>(k, DequantizeM(a.s.m_code + e, m_step), g);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(k.one_minus_beta2, g), g,
                                     _mm512_mul_ps(DequantizeV(a.s.v_code + e, v_step), k.beta2));
    const __m512 r = _mm512_sqrt_ps(v);
    const __m512 denom = _mm512_add_ps(DivideBySqrtBc2(k, r), k.eps);
    *m_out = m;
    *r_out = _mm512_mask_mov_ps(r, _mm512_cmpeq_epi32_mask(_mm512_castps_si512(r), Set1(0x7f800000)),
                                _mm512_castsi512_ps(Set1(0x7f7fffff)));  // SaturateRoot (compact_scale.h)
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.neg_step_size, m), denom));
  }

  static void Block(const AdamConstsx16& k, const CompactArrays& a, size_t i) {
    const size_t b = i / kCompactBlock;
    const __m512 m_step = _mm512_set1_ps(a.s.m_scale[b] / kMCodeSquared);
    const __m512 v_step = _mm512_set1_ps(a.s.v_scale[b] / kVCodeSquared);
    __m512 m[kVectors], r[kVectors];
#pragma GCC unroll 4
    for (size_t v = 0; v < kVectors; ++v) {
      const size_t e = i + v * kAvx512Lanes;
      const __m512 p = Update(k, a, e, m_step, v_step, &m[v], &r[v]);
      __m512i hi, lo;
      Split(p, &hi, &lo);
      const __m256i h16 = _mm512_cvtepi32_epi16(hi);
      StoreU16x16(a.s.w_hi, e, h16);
      if constexpr (C == CompactCopy::kBF16) StoreU16x16(a.param_copy, e, h16);
      Store16Bytes(a.s.w_lo + e, lo);
      StoreCopy<C>(a.param_copy, e, p);
    }
    StoreMoments(a.s, i, m, r);
  }

  static void Run(const AdamStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    const AdamConstsx16 k(s);
    const CompactArrays local = a;  // the stores cannot change `a`; keep pointers in registers
    size_t i = begin;
    for (; i + kCompactBlock <= end; i += kCompactBlock) {
      const size_t ahead = i + kPrefetchAhead;
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_hi + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_lo + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.m_code + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.v_code + ahead), _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(local.grad) + ahead * DTypeSize(G), _MM_HINT_T0);
      Block(k, local, i);
    }
    if (i < end)
      RunCompactTail(a, i, end - i, DTypeSize(G), CompactCopyBytes(C),
                     [&](const CompactArrays& x) { Block(k, x, 0); });
  }
};

// Lion (LionAvx512's operations) on the dequantized state, block by block.
template <DType G, CompactCopy C>
struct CompactLionAvx512 {
  static void Block(const LionConstsx16& k, const CompactArrays& a, size_t i) {
    const __m512 m_step = _mm512_set1_ps(a.s.m_scale[i / kCompactBlock] / kMCodeSquared);
    __m512 m_new[kVectors];
#pragma GCC unroll 4
    for (size_t v = 0; v < kVectors; ++v) {
      const size_t e = i + v * kAvx512Lanes;
      const __m512 g = _mm512_mul_ps(LoadAsF32x16<G>(a.grad, e), k.grad_scale);
      const __m512 m = DequantizeM(a.s.m_code + e, m_step);
      __m512 p = _mm512_mul_ps(Rebuild(a.s.w_hi + e, a.s.w_lo + e), k.decay);
      const __m512 c = _mm512_fmadd_ps(k.one_minus_beta1, g, _mm512_mul_ps(m, k.beta1));
      p = _mm512_fmadd_ps(k.neg_lr, Sign(c), p);
      __m512i hi, lo;
      Split(p, &hi, &lo);
      const __m256i h16 = _mm512_cvtepi32_epi16(hi);
      StoreU16x16(a.s.w_hi, e, h16);
      if constexpr (C == CompactCopy::kBF16) StoreU16x16(a.param_copy, e, h16);
      Store16Bytes(a.s.w_lo + e, lo);
      StoreCopy<C>(a.param_copy, e, p);
      m_new[v] = _mm512_fmadd_ps(k.one_minus_beta2, g, _mm512_mul_ps(m, k.beta2));
    }
    StoreMoments(a.s, i, m_new, nullptr);
  }

  static void Run(const LionStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    const LionConstsx16 k(s);
    const CompactArrays local = a;
    size_t i = begin;
    for (; i + kCompactBlock <= end; i += kCompactBlock) {
      const size_t ahead = i + kPrefetchAhead;
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_hi + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_lo + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.m_code + ahead), _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(local.grad) + ahead * DTypeSize(G), _MM_HINT_T0);
      Block(k, local, i);
    }
    if (i < end)
      RunCompactTail(a, i, end - i, DTypeSize(G), CompactCopyBytes(C),
                     [&](const CompactArrays& x) { Block(k, x, 0); });
  }
};

}  // namespace

CompactLionRangeFn SelectCompactLionAvx512(DType grad, CompactCopy copy) {
  return PickCompactLion<CompactLionAvx512>(grad, copy);
}

CompactAdamRangeFn SelectCompactAdamAvx512(DType grad, CompactCopy copy, bool l2, bool lerp) {
  return PickCompactAdam<CompactAdamAvx512>(grad, copy, l2, lerp);
}

}  // namespace strata::kernels::internal
