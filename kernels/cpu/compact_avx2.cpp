// AVX2 + FMA path of the compact Adam/AdamW step: a block of 32 elements is
// four vectors of 8; the scalar reference's integer and IEEE operations in the
// same order (the update is adam_avx2.cpp's), so results are bitwise equal.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/simd_avx2.h"

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kVectors = kCompactBlock / kAvx2Lanes;  // 4

struct Constsx8 {
  explicit Constsx8(const AdamStepScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)),
        l2(_mm256_set1_ps(s.l2)),
        decay(_mm256_set1_ps(s.decay)),
        beta1(_mm256_set1_ps(s.beta1)),
        one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)),
        beta2(_mm256_set1_ps(s.beta2)),
        one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        sqrt_bc2(_mm256_set1_ps(s.sqrt_bc2)),
        inv_sqrt_bc2(_mm256_set1_ps(s.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(s.eps)),
        neg_step_size(_mm256_set1_ps(s.neg_step_size)) {}
  __m256 grad_scale, l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, inv_sqrt_bc2, eps,
      neg_step_size;
};

inline __m256i Set1(int32_t x) { return _mm256_set1_epi32(x); }

// x / sqrt_bc2 correctly rounded without vdivps, as adam_avx2.cpp.
inline __m256 DivideBySqrtBc2(const Constsx8& k, __m256 x) {
  const __m256 q0 = _mm256_mul_ps(x, k.inv_sqrt_bc2);
  const __m256 r = _mm256_fnmadd_ps(q0, k.sqrt_bc2, x);
  const __m256 q1 = _mm256_fmadd_ps(r, k.inv_sqrt_bc2, q0);
  return _mm256_blendv_ps(q1, q0, _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_inff()), _CMP_EQ_OQ));
}

// Rebuild in compact_elements.h. w and hi share the sign bit, so adding the
// signed magnitude difference to hi's bits adds it to the magnitude.
inline __m256 Rebuild(const uint16_t* hi, const int8_t* lo) {
  const __m256i h =
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 16);
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)));
  const __m256i d = _mm256_srai_epi32(_mm256_add_epi32(_mm256_mullo_epi32(q, Set1(33026)), Set1(64)), 7);
  return _mm256_castsi256_ps(_mm256_add_epi32(h, d));
}

// Split in compact_elements.h: bf16 lanes (low halves) and corrections. The
// rounding keeps the sign, so d = bits(w) - bits(hi) is the magnitudes'
// difference. Past bf16's range a finite w (|w| bits in [0x7f7fff7f,
// 0x7f7fffff], where q is 0) gets q = -1; inf and NaN get 0.
inline void Split(__m256 p, __m256i* hi, __m256i* lo) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, Set1(1)), Set1(0x7fff));
  const __m256i hb = _mm256_and_si256(_mm256_add_epi32(u, bias), Set1(static_cast<int32_t>(0xffff0000u)));
  const __m256i abs = _mm256_and_si256(u, Set1(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, Set1(0x7f800000));
  *hi = _mm256_blendv_epi8(_mm256_srli_epi32(hb, 16), _mm256_or_si256(high, Set1(0x40)), nan);
  const __m256i d = _mm256_sub_epi32(u, hb);
  const __m256i q =
      _mm256_srai_epi32(_mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(d, 7), d), Set1(16384)), 15);
  const __m256i top = _mm256_cmpgt_epi32(abs, Set1(0x7f7fff7e));  // the top 129 floats, inf, NaN
  const __m256i nonfinite = _mm256_cmpgt_epi32(abs, Set1(0x7f7fffff));
  *lo = _mm256_andnot_si256(nonfinite, _mm256_add_epi32(q, top));
}

inline __m256 DequantizeM(const int8_t* code, __m256 step) {
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(q, _mm256_abs_epi32(q))), step);
}
inline __m256 DequantizeV(const uint8_t* code, __m256 step) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(q, q)), step);
  return _mm256_mul_ps(t, t);
}

// Largest |x| bits over the block's four vectors (integer max, as MaxAbsBits).
inline uint32_t MaxAbsBits(const __m256 (&x)[kVectors]) {
  __m256i mx = _mm256_setzero_si256();
  for (size_t k = 0; k < kVectors; ++k)
    mx = _mm256_max_epi32(mx, _mm256_and_si256(_mm256_castps_si256(x[k]), Set1(0x7fffffff)));
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
}

// Codes of a live block (CodeOf in compact_elements.h): y = |x|*k, then the
// largest q <= cap with (q - 1/2)^2 <= y. The divider is the scarce unit of
// this step (sqrt(v) and the update's division need it), so the first guess
// comes from an inverse square root by bits with one Newton step (within 0.3
// of sqrt(y) for y <= 2^14, so within one of q) and exact compares finish it.
inline __m256i Codes(__m256 x, __m256 k, int32_t cap) {
  const __m256 y = _mm256_mul_ps(_mm256_and_ps(x, _mm256_castsi256_ps(Set1(0x7fffffff))), k);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 r0 =
      _mm256_castsi256_ps(_mm256_sub_epi32(Set1(0x5f3759df), _mm256_srli_epi32(_mm256_castps_si256(y), 1)));
  const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(y, half), r0), r0);
  const __m256 r1 = _mm256_mul_ps(r0, _mm256_sub_ps(_mm256_set1_ps(1.5f), t));
  const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(y, r1));
  const __m256 qf = _mm256_cvtepi32_ps(q0);
  const __m256 up = _mm256_add_ps(qf, half), down = _mm256_sub_ps(qf, half);
  const __m256 raise = _mm256_cmp_ps(_mm256_mul_ps(up, up), y, _CMP_LE_OQ);
  const __m256 lower = _mm256_cmp_ps(_mm256_mul_ps(down, down), y, _CMP_GT_OQ);
  __m256i q = _mm256_sub_epi32(q0, _mm256_castps_si256(raise));
  q = _mm256_max_epi32(_mm256_add_epi32(q, _mm256_castps_si256(lower)), _mm256_setzero_si256());
  return _mm256_min_epi32(q, Set1(cap));
}

// Four vectors of 8 int32 (each fitting the byte type) -> 32 bytes in order.
inline __m256i PackBytes(const __m256i (&q)[kVectors], bool is_signed) {
  const __m256i ab = is_signed ? _mm256_packs_epi32(q[0], q[1]) : _mm256_packus_epi32(q[0], q[1]);
  const __m256i cd = is_signed ? _mm256_packs_epi32(q[2], q[3]) : _mm256_packus_epi32(q[2], q[3]);
  const __m256i b = is_signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline void Store32(void* dst, __m256i x) { _mm256_storeu_si256(static_cast<__m256i*>(dst), x); }

// The block's new moments -> codes and scales (QuantizeM, QuantizeV,
// ZeroMWhereVZero in compact_elements.h).
[[gnu::always_inline]] inline void StoreMoments(const CompactState& s, size_t i, const __m256 (&m)[kVectors],
                                                const __m256 (&r)[kVectors]) {
  const size_t b = i / kCompactBlock;
  const uint32_t amax = MaxAbsBits(m), rmax = MaxAbsBits(r);
  const float a = BitsF32(amax), big = BitsF32(rmax);
  const bool m_live = amax < 0x7f800000u && a >= kCompactMinScale;
  const bool v_live = rmax < 0x7f800000u && big > 0.0f;
  s.m_scale[b] = m_live ? a : (amax < 0x7f800000u ? 0.0f : BitsF32(0x7fc00000u));
  s.v_scale[b] = v_live ? big : (rmax < 0x7f800000u ? 0.0f : BitsF32(0x7fc00000u));
  __m256i qm[kVectors], qv[kVectors];
  const __m256 km = _mm256_set1_ps(m_live ? 16129.0f / a : 0.0f);
  const __m256 kv = _mm256_set1_ps(v_live ? 65025.0f / big : 0.0f);
  for (size_t k = 0; k < kVectors; ++k) {
    qv[k] = v_live ? Codes(r[k], kv, 255) : _mm256_setzero_si256();
    const __m256i q =
        m_live ? _mm256_sign_epi32(Codes(m[k], km, 127), _mm256_castps_si256(m[k])) : _mm256_setzero_si256();
    qm[k] = _mm256_andnot_si256(_mm256_cmpeq_epi32(qv[k], _mm256_setzero_si256()), q);
  }
  Store32(s.m_code + i, PackBytes(qm, true));
  Store32(s.v_code + i, PackBytes(qv, false));
}

template <CompactCopy C>
inline void StoreCopy(void* copy, size_t i, __m256 p) {
  if constexpr (C == CompactCopy::kF16) StoreFromF32x8<DType::kF16>(copy, i, p);
  if constexpr (C == CompactCopy::kF32) StoreFromF32x8<DType::kF32>(copy, i, p);
}

template <DType G, CompactCopy C, bool kL2>
struct CompactAdamAvx2 {
  // One whole block at i (a multiple of kCompactBlock): AdamAvx2::Update's
  // operations on the dequantized state, in phases over the four vectors so
  // that their square roots and divisions (long latencies, one divider) are
  // in flight together; then the split, the copy-out and the moments.
  static void Block(const Constsx8& k, const CompactArrays& a, size_t i) {
    const size_t b = i / kCompactBlock;
    const __m256 m_step = _mm256_set1_ps(a.s.m_scale[b] / 16129.0f);
    const __m256 v_step = _mm256_set1_ps(a.s.v_scale[b] / 65025.0f);
    __m256 p[kVectors], m[kVectors], r[kVectors];
    for (size_t v = 0; v < kVectors; ++v) {
      const size_t e = i + v * kAvx2Lanes;
      __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, e), k.grad_scale);
      p[v] = Rebuild(a.s.w_hi + e, a.s.w_lo + e);
      if constexpr (kL2) g = _mm256_fmadd_ps(p[v], k.l2, g);
      p[v] = _mm256_mul_ps(p[v], k.decay);
      m[v] =
          _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(DequantizeM(a.s.m_code + e, m_step), k.beta1));
      const __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, g), g,
                                        _mm256_mul_ps(DequantizeV(a.s.v_code + e, v_step), k.beta2));
      r[v] = _mm256_sqrt_ps(vv);
    }
    for (size_t v = 0; v < kVectors; ++v) {
      const __m256 denom = _mm256_add_ps(DivideBySqrtBc2(k, r[v]), k.eps);
      p[v] = _mm256_add_ps(p[v], _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m[v]), denom));
    }
    __m256i hi[kVectors], lo[kVectors];
    for (size_t v = 0; v < kVectors; ++v) {
      Split(p[v], &hi[v], &lo[v]);
      StoreCopy<C>(a.param_copy, i + v * kAvx2Lanes, p[v]);
    }
    const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[0], hi[1]), 0xd8);
    const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[2], hi[3]), 0xd8);
    Store32(a.s.w_hi + i, h01);
    Store32(a.s.w_hi + i + 16, h23);
    if constexpr (C == CompactCopy::kBF16) {
      Store32(static_cast<uint16_t*>(a.param_copy) + i, h01);
      Store32(static_cast<uint16_t*>(a.param_copy) + i + 16, h23);
    }
    Store32(a.s.w_lo + i, PackBytes(lo, true));
    StoreMoments(a.s, i, m, r);
  }

  static void Run(const AdamStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    const Constsx8 k(s);
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
    if (i < end) Tail(k, a, i, end - i);
  }

  // The last, partial block: zero-padded stack copies run the block body (the
  // padding reads as 0 and cannot raise a block maximum), then r elements and
  // the two scales go back.
  static void Tail(const Constsx8& k, const CompactArrays& a, size_t i, size_t r) {
    alignas(64) uint16_t hi[kCompactBlock] = {};
    alignas(64) int8_t lo[kCompactBlock] = {}, mq[kCompactBlock] = {};
    alignas(64) uint8_t vq[kCompactBlock] = {};
    alignas(64) uint8_t grad[4 * kCompactBlock] = {}, copy[4 * kCompactBlock] = {};
    const size_t b = i / kCompactBlock;
    float ms = a.s.m_scale[b], vs = a.s.v_scale[b];
    std::memcpy(hi, a.s.w_hi + i, 2 * r);
    std::memcpy(lo, a.s.w_lo + i, r);
    std::memcpy(mq, a.s.m_code + i, r);
    std::memcpy(vq, a.s.v_code + i, r);
    std::memcpy(grad, static_cast<const uint8_t*>(a.grad) + i * DTypeSize(G), r * DTypeSize(G));
    const CompactArrays x{{hi, lo, mq, &ms, vq, &vs}, grad, copy};
    Block(k, x, 0);
    std::memcpy(a.s.w_hi + i, hi, 2 * r);
    std::memcpy(a.s.w_lo + i, lo, r);
    std::memcpy(a.s.m_code + i, mq, r);
    std::memcpy(a.s.v_code + i, vq, r);
    a.s.m_scale[b] = ms;
    a.s.v_scale[b] = vs;
    const size_t copy_bytes = C == CompactCopy::kF32 ? 4 : C == CompactCopy::kNone ? 0 : 2;
    if (copy_bytes) std::memcpy(static_cast<uint8_t*>(a.param_copy) + i * copy_bytes, copy, r * copy_bytes);
  }
};

template <DType G, CompactCopy C>
CompactAdamRangeFn PickL2(bool l2) {
  return l2 ? &CompactAdamAvx2<G, C, true>::Run : &CompactAdamAvx2<G, C, false>::Run;
}

template <DType G>
CompactAdamRangeFn PickCopy(CompactCopy copy, bool l2) {
  switch (copy) {
    case CompactCopy::kBF16:
      return PickL2<G, CompactCopy::kBF16>(l2);
    case CompactCopy::kF16:
      return PickL2<G, CompactCopy::kF16>(l2);
    case CompactCopy::kF32:
      return PickL2<G, CompactCopy::kF32>(l2);
    case CompactCopy::kNone:
      break;
  }
  return PickL2<G, CompactCopy::kNone>(l2);
}

}  // namespace

CompactAdamRangeFn SelectCompactAdamAvx2(DType grad, CompactCopy copy, bool l2) {
  if (grad == DType::kBF16) return PickCopy<DType::kBF16>(copy, l2);
  if (grad == DType::kF16) return PickCopy<DType::kF16>(copy, l2);
  return PickCopy<DType::kF32>(copy, l2);
}

}  // namespace strata::kernels::internal
