// AVX2 + FMA path of the compact Adam/AdamW step: a block of 32 elements is
// four vectors of 8; the scalar reference's integer and IEEE operations in the
// same order (the update is adam_avx2.cpp's), so results are bitwise equal.
// Adam runs eight blocks at a time in passes (see CompactAdamAvx2).
#include <algorithm>
#include <cstring>

#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/compact_scale.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx2.h"
#include "kernels/cpu/compact_tail.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/simd_avx2.h"

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kVectors = kCompactBlock / kAvx2Lanes;  // 4

inline __m256i Set1(int32_t x) { return _mm256_set1_epi32(x); }

// The integer constants, made once per range and hidden from the optimizer:
// GCC would otherwise rebuild each at every use (mov, vmovd, vpbroadcastd:
// three instructions where a register or a memory operand costs none).
struct Ints {
  Ints()
      : abs(Set1(0x7fffffff)),
        mul(Set1(33026)),
        c64(Set1(64)),
        one(Set1(1)),
        c7fff(Set1(0x7fff)),
        hi16(Set1(static_cast<int32_t>(0xffff0000u))),
        quiet(Set1(0x40)),
        inf(Set1(0x7f800000)),
        c16384(Set1(16384)),
        top(Set1(0x7f7fff7e)),
        fmax(Set1(0x7f7fffff)),
        c127(Set1(127)),
        c255(Set1(255)),
        perm(_mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)) {
    for (__m256i* x :
         {&abs, &mul, &c64, &one, &c7fff, &hi16, &quiet, &inf, &c16384, &top, &fmax, &c127, &c255, &perm})
      __asm__("" : "+x"(*x));
  }
  __m256i abs, mul, c64, one, c7fff, hi16, quiet, inf, c16384, top, fmax, c127, c255, perm;
};

// Rebuild in compact_elements.h: hi's sign, and the signed magnitude
// difference added to hi's magnitude (as the scalar does: adding it to the
// whole word differed only for a state Split never writes, hi = +-0 with a
// negative correction, whose NaN then took the other sign).
inline __m256 Rebuild(const Ints& c, const uint16_t* hi, const int8_t* lo) {
  const __m256i h =
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 16);
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)));
  const __m256i d = _mm256_srai_epi32(_mm256_add_epi32(_mm256_mullo_epi32(q, c.mul), c.c64), 7);
  return _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_andnot_si256(c.abs, h), _mm256_add_epi32(_mm256_and_si256(h, c.abs), d)));
}

// Split in compact_elements.h: bf16 lanes (low halves) and corrections. The
// rounding keeps the sign, so d = bits(w) - bits(hi) is the magnitudes'
// difference. Past bf16's range a finite w (|w| bits in [0x7f7fff7f,
// 0x7f7fffff], where q is 0) gets q = -1; inf and NaN get 0.
inline void Split(const Ints& c, __m256 p, __m256i* hi, __m256i* lo) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, c.one), c.c7fff);
  const __m256i hb = _mm256_and_si256(_mm256_add_epi32(u, bias), c.hi16);
  const __m256i abs = _mm256_and_si256(u, c.abs);
  const __m256i nan = _mm256_cmpgt_epi32(abs, c.inf);
  *hi = _mm256_blendv_epi8(_mm256_srli_epi32(hb, 16), _mm256_or_si256(high, c.quiet), nan);
  const __m256i d = _mm256_sub_epi32(u, hb);
  const __m256i q =
      _mm256_srai_epi32(_mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(d, 7), d), c.c16384), 15);
  const __m256i top = _mm256_cmpgt_epi32(abs, c.top);  // the top 129 floats, inf, NaN
  const __m256i nonfinite = _mm256_cmpgt_epi32(abs, c.fmax);
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
inline uint32_t MaxAbsBits(const Ints& c, const __m256* x) {
  __m256i mx = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (size_t k = 0; k < kVectors; ++k)
    mx = _mm256_max_epi32(mx, _mm256_and_si256(_mm256_castps_si256(x[k]), c.abs));
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
}

// Codes of a live block (CodeOf in compact_elements.h): rint(sqrt(|x|*k)),
// capped. vsqrtps is correctly rounded and vcvtps2dq rounds to nearest even,
// as the scalar reference.
inline __m256i Codes(const Ints& c, __m256 x, __m256 k, __m256i cap) {
  const __m256 y = _mm256_mul_ps(_mm256_and_ps(x, _mm256_castsi256_ps(c.abs)), k);
  return _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_sqrt_ps(y)), cap);
}

// SaturateRoot (compact_scale.h) of 8 lanes: +inf -> the largest float.
inline __m256 SaturateRoot(const Ints& c, __m256 r) {
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(c.fmax),
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(r), c.inf)));
}

// Four vectors of 8 int32 (each fitting the byte type) -> 32 bytes in order.
inline __m256i PackBytes(const Ints& c, const __m256i (&q)[kVectors], bool is_signed) {
  const __m256i ab = is_signed ? _mm256_packs_epi32(q[0], q[1]) : _mm256_packus_epi32(q[0], q[1]);
  const __m256i cd = is_signed ? _mm256_packs_epi32(q[2], q[3]) : _mm256_packus_epi32(q[2], q[3]);
  const __m256i b = is_signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  return _mm256_permutevar8x32_epi32(b, c.perm);
}

inline void Store32(void* dst, __m256i x) { _mm256_storeu_si256(static_cast<__m256i*>(dst), x); }

// Codes of one block (QuantizeM, QuantizeV, ZeroMWhereVZero in
// compact_elements.h) from its new moments m and r = sqrt(v), given the
// block's factors and live flags. r == nullptr: Lion, m codes only (no v, so
// no zero-v rule).
[[gnu::always_inline]] inline void StoreCodes(const Ints& c, const CompactState& s, size_t i, const __m256* m,
                                              const __m256* r, __m256 km, __m256 kv, bool m_live, bool v_live) {
  __m256i qm[kVectors], qv[kVectors];
#pragma GCC unroll 4
  for (size_t k = 0; k < kVectors; ++k) {
    qm[k] = m_live ? _mm256_sign_epi32(Codes(c, m[k], km, c.c127), _mm256_castps_si256(m[k]))
                   : _mm256_setzero_si256();
    if (r == nullptr) continue;
    qv[k] = v_live ? Codes(c, r[k], kv, c.c255) : _mm256_setzero_si256();
    qm[k] = _mm256_andnot_si256(_mm256_cmpeq_epi32(qv[k], _mm256_setzero_si256()), qm[k]);
  }
  Store32(s.m_code + i, PackBytes(c, qm, true));
  if (r != nullptr) Store32(s.v_code + i, PackBytes(c, qv, false));
}

// One block's scales (compact_scale.h) and codes from its new moments; r ==
// nullptr for Lion.
[[gnu::always_inline]] inline void StoreMoments(const Ints& c, const CompactState& s, size_t i,
                                                const __m256 (&m)[kVectors], const __m256* r) {
  const size_t b = i / kCompactBlock;
  const BlockScale ms = MBlockScale(MaxAbsBits(c, m));
  s.m_scale[b] = ms.stored;
  BlockScale vs{};
  if (r != nullptr) {
    vs = VBlockScale(MaxAbsBits(c, r));
    s.v_scale[b] = vs.stored;
  }
  StoreCodes(c, s, i, m, r, _mm256_set1_ps(ms.k), _mm256_set1_ps(vs.k), ms.live, vs.live);
}

// The block's new masters, split: w_hi (and a bf16 copy-out), w_lo.
template <CompactCopy C>
inline void StoreMaster(const Ints& c, const CompactArrays& a, size_t i, const __m256i (&hi)[kVectors],
                        const __m256i (&lo)[kVectors]) {
  const __m256i h01 = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[0], hi[1]), 0xd8);
  const __m256i h23 = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[2], hi[3]), 0xd8);
  Store32(a.s.w_hi + i, h01);
  Store32(a.s.w_hi + i + 16, h23);
  if constexpr (C == CompactCopy::kBF16) {
    Store32(static_cast<uint16_t*>(a.param_copy) + i, h01);
    Store32(static_cast<uint16_t*>(a.param_copy) + i + 16, h23);
  }
  Store32(a.s.w_lo + i, PackBytes(c, lo, true));
}

template <CompactCopy C>
inline void StoreCopy(void* copy, size_t i, __m256 p) {
  if constexpr (C == CompactCopy::kF16) StoreFromF32x8<DType::kF16>(copy, i, p);
  if constexpr (C == CompactCopy::kF32) StoreFromF32x8<DType::kF32>(copy, i, p);
}

// Split's usual case: a w whose magnitude is at most the largest float below
// bf16's range (|w| bits <= 0x7f7fff7e), where the correction is q itself.
// `big` collects |w| bits shifted left by one (sign out), to tell afterwards
// whether a lane needs Split's special cases (top floats, inf, NaN).
inline void SplitUsual(const Ints& c, __m256 p, __m256i* hi, __m256i* lo, __m256i* big) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), c.one), c.c7fff);
  const __m256i hb = _mm256_and_si256(_mm256_add_epi32(u, bias), c.hi16);
  *hi = _mm256_srli_epi32(hb, 16);
  const __m256i d = _mm256_sub_epi32(u, hb);
  *lo = _mm256_srai_epi32(_mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(d, 7), d), c.c16384), 15);
  *big = _mm256_max_epu32(*big, _mm256_add_epi32(u, u));
}

// Whether some lane of SplitUsual's `big` had |w| bits above 0x7f7fff7e.
inline bool NeedsSplitSpecials(__m256i big) {
  const __m256i limit = _mm256_set1_epi32(static_cast<int32_t>(0x7f7fff7eu << 1));
  const __m256i above = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(big, limit), limit),
                                         _mm256_set1_epi32(-1));
  return !_mm256_testz_si256(above, above);
}

// Eight lanes of b-th block values as one vector per block -> one vector of
// the eight blocks' maxima (signed max of |x| bits: NaN wins, as MaxAbsBits).
inline __m256i MaxOfEach(const __m256i (&x)[8]) {
  __m256i s[4];
  for (int k = 0; k < 4; ++k) {  // lanes j: max over pairs, blocks 2k and 2k+1 interleaved
    const __m256i a = x[2 * k], b = x[2 * k + 1];
    s[k] = _mm256_max_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  }
  __m256i t[2];
  for (int k = 0; k < 2; ++k) {
    const __m256i a = s[2 * k], b = s[2 * k + 1];
    t[k] = _mm256_max_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
  }
  // t[0]: blocks 0,1,2,3 in each 128-bit lane (partial maxima of lane halves); t[1]: 4..7.
  const __m256i lo = _mm256_permute2x128_si256(t[0], t[1], 0x20);
  const __m256i hi = _mm256_permute2x128_si256(t[0], t[1], 0x31);
  return _mm256_max_epi32(lo, hi);  // block order: 0 1 2 3 4 5 6 7
}

template <DType G, CompactCopy C, bool kL2, bool kLerp>
struct CompactAdamAvx2 {
  // A group of blocks goes through short passes, each a loop of independent
  // iterations: one element's whole chain (dequantize, square root, divisions,
  // split, maximum, division, square root of the code) is far longer than the
  // core's window holds, so in one pass the window would wait on it; in
  // passes, a later pass finds its inputs ready. The group's scales are also
  // divided eight at a time.
  static constexpr size_t kGroup = 8;
  static constexpr size_t kGroupVectors = kGroup * kVectors;

  struct Scratch {
    __m256 p[kGroupVectors], m[kGroupVectors], r[kGroupVectors];
    __m256i m_max[kGroup], r_max[kGroup];
    alignas(32) float m_step[kGroup], v_step[kGroup], km[kGroup], kv[kGroup];
  };

  // nb (1..kGroup) whole blocks at i (a multiple of kCompactBlock):
  // AdamAvx2::Update's operations on the dequantized state, then the split
  // master, the new scales and the codes.
  static void Group(const AdamConstsx8& k, const Ints& c, const CompactArrays& a, size_t i, size_t nb,
                    Scratch& x) {
    const size_t b0 = i / kCompactBlock, nv = nb * kVectors;
    // The dequantization steps of the old scales (MStep, VStep), eight at a time.
    alignas(32) float ms[kGroup] = {}, vs[kGroup] = {};
    for (size_t b = 0; b < nb; ++b) ms[b] = a.s.m_scale[b0 + b], vs[b] = a.s.v_scale[b0 + b];
    _mm256_store_ps(x.m_step, _mm256_div_ps(_mm256_load_ps(ms), _mm256_set1_ps(kMCodeSquared)));
    _mm256_store_ps(x.v_step, _mm256_div_ps(_mm256_load_ps(vs), _mm256_set1_ps(kVCodeSquared)));
    // Pass 1: the new moments, sqrt(v), and the decayed master.
    for (size_t j = 0; j < nv; ++j) {
      const size_t e = i + j * kAvx2Lanes, b = j / kVectors;
      __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, e), k.grad_scale);
      __m256 p = Rebuild(c, a.s.w_hi + e, a.s.w_lo + e);
      if constexpr (kL2) g = _mm256_fmadd_ps(p, k.l2, g);
      x.p[j] = _mm256_mul_ps(p, k.decay);
      const __m256 m = FirstMoment<kLerp>(k, DequantizeM(a.s.m_code + e, _mm256_broadcast_ss(&x.m_step[b])), g);
      const __m256 vv = _mm256_fmadd_ps(
          _mm256_mul_ps(k.one_minus_beta2, g), g,
          _mm256_mul_ps(DequantizeV(a.s.v_code + e, _mm256_broadcast_ss(&x.v_step[b])), k.beta2));
      x.m[j] = m;
      x.r[j] = _mm256_sqrt_ps(vv);
    }
    // Pass 2: the update of the master.
    for (size_t j = 0; j < nv; ++j) {
      const __m256 denom = _mm256_add_ps(DivideBySqrtBc2(k, x.r[j]), k.eps);
      x.p[j] = _mm256_add_ps(x.p[j], _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, x.m[j]), denom));
    }
    // Pass 3: the split master (and the copy-out), the blocks' maxima.
    for (size_t b = 0; b < nb; ++b) {
      const size_t ib = i + b * kCompactBlock;
      __m256i hi[kVectors], lo[kVectors];
      __m256i big = _mm256_setzero_si256(), m_max = _mm256_setzero_si256(), r_max = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (size_t v = 0; v < kVectors; ++v) {
        const size_t j = b * kVectors + v;
        SplitUsual(c, x.p[j], &hi[v], &lo[v], &big);
        StoreCopy<C>(a.param_copy, ib + v * kAvx2Lanes, x.p[j]);
        m_max = _mm256_max_epi32(m_max, _mm256_and_si256(_mm256_castps_si256(x.m[j]), c.abs));
        x.r[j] = SaturateRoot(c, x.r[j]);  // (pass 2's update used it as it was)
        r_max = _mm256_max_epi32(r_max, _mm256_and_si256(_mm256_castps_si256(x.r[j]), c.abs));
      }
      if (NeedsSplitSpecials(big)) [[unlikely]] {
        for (size_t v = 0; v < kVectors; ++v) Split(c, x.p[b * kVectors + v], &hi[v], &lo[v]);
      }
      StoreMaster<C>(c, a, ib, hi, lo);
      x.m_max[b] = m_max;
      x.r_max[b] = r_max;
    }
    for (size_t b = nb; b < kGroup; ++b) x.m_max[b] = x.r_max[b] = _mm256_setzero_si256();
    // New scales, MBlockScale and VBlockScale (compact_scale.h) eight blocks at
    // a time: A = max |m|, R = max sqrt(v) a block.
    const __m256i amax = MaxOfEach(x.m_max), rmax = MaxOfEach(x.r_max);
    const __m256 a_f = _mm256_castsi256_ps(amax), r_f = _mm256_castsi256_ps(rmax);
    const __m256 m_finite = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c.inf, amax));
    const __m256 v_finite = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c.inf, rmax));
    const __m256 m_live =
        _mm256_and_ps(m_finite, _mm256_cmp_ps(a_f, _mm256_set1_ps(kCompactMinScale), _CMP_GE_OQ));
    const __m256 v_live = _mm256_and_ps(v_finite, _mm256_cmp_ps(r_f, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(kScaleNaNBits)));
    // Live: the maximum; finite but not live: 0; else NaN.
    _mm256_store_ps(ms, _mm256_or_ps(_mm256_and_ps(m_live, a_f), _mm256_andnot_ps(m_finite, nan)));
    _mm256_store_ps(vs, _mm256_or_ps(_mm256_and_ps(v_live, r_f), _mm256_andnot_ps(v_finite, nan)));
    for (size_t b = 0; b < nb; ++b) a.s.m_scale[b0 + b] = ms[b], a.s.v_scale[b0 + b] = vs[b];
    _mm256_store_ps(x.km, _mm256_div_ps(_mm256_set1_ps(kMCodeSquared), a_f));
    _mm256_store_ps(x.kv, _mm256_div_ps(_mm256_set1_ps(kVCodeSquared), r_f));
    const unsigned m_bits = static_cast<unsigned>(_mm256_movemask_ps(m_live));
    const unsigned v_bits = static_cast<unsigned>(_mm256_movemask_ps(v_live));
    // Pass 4: the codes.
    for (size_t b = 0; b < nb; ++b)
      StoreCodes(c, a.s, i + b * kCompactBlock, &x.m[b * kVectors], &x.r[b * kVectors],
                 _mm256_broadcast_ss(&x.km[b]), _mm256_broadcast_ss(&x.kv[b]), (m_bits >> b) & 1,
                 (v_bits >> b) & 1);
  }

  static void Run(const AdamStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    const AdamConstsx8 k(s);
    const Ints c;
    const CompactArrays local = a;  // the stores cannot change `a`; keep pointers in registers
    Scratch x;
    size_t i = begin;
    while (i + kCompactBlock <= end) {
      const size_t nb = std::min(kGroup, (end - i) / kCompactBlock);
      for (size_t j = i; j < i + nb * kCompactBlock; j += kCompactBlock) {
        const size_t ahead = j + kPrefetchAhead;
        _mm_prefetch(reinterpret_cast<const char*>(local.s.w_hi + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(local.s.w_lo + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(local.s.m_code + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(local.s.v_code + ahead), _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(local.grad) + ahead * DTypeSize(G), _MM_HINT_T0);
      }
      Group(k, c, local, i, nb, x);
      i += nb * kCompactBlock;
    }
    if (i < end)
      RunCompactTail(a, i, end - i, DTypeSize(G), CompactCopyBytes(C),
                     [&](const CompactArrays& t) { Group(k, c, t, 0, 1, x); });
  }
};

// Lion (LionAvx2's operations) on the dequantized state, block by block.
template <DType G, CompactCopy C>
struct CompactLionAvx2 {
  static void Block(const LionConstsx8& k, const Ints& c, const CompactArrays& a, size_t i) {
    const __m256 m_step = _mm256_set1_ps(a.s.m_scale[i / kCompactBlock] / kMCodeSquared);
    __m256 m_new[kVectors];
    __m256i hi[kVectors], lo[kVectors];
#pragma GCC unroll 4
    for (size_t v = 0; v < kVectors; ++v) {
      const size_t e = i + v * kAvx2Lanes;
      const __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, e), k.grad_scale);
      const __m256 m = DequantizeM(a.s.m_code + e, m_step);
      __m256 p = _mm256_mul_ps(Rebuild(c, a.s.w_hi + e, a.s.w_lo + e), k.decay);
      const __m256 mix = _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(m, k.beta1));
      p = _mm256_fmadd_ps(k.neg_lr, Sign(mix), p);
      Split(c, p, &hi[v], &lo[v]);
      StoreCopy<C>(a.param_copy, e, p);
      m_new[v] = _mm256_fmadd_ps(k.one_minus_beta2, g, _mm256_mul_ps(m, k.beta2));
    }
    StoreMaster<C>(c, a, i, hi, lo);
    StoreMoments(c, a.s, i, m_new, nullptr);
  }

  static void Run(const LionStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    const LionConstsx8 k(s);
    const Ints c;
    const CompactArrays local = a;
    size_t i = begin;
    for (; i + kCompactBlock <= end; i += kCompactBlock) {
      const size_t ahead = i + kPrefetchAhead;
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_hi + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.w_lo + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(local.s.m_code + ahead), _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(local.grad) + ahead * DTypeSize(G), _MM_HINT_T0);
      Block(k, c, local, i);
    }
    if (i < end)
      RunCompactTail(a, i, end - i, DTypeSize(G), CompactCopyBytes(C),
                     [&](const CompactArrays& x) { Block(k, c, x, 0); });
  }
};

}  // namespace

// CompactPackRange's operations in vectors, block by block (the partial last
// block by the scalar reference): Split, sqrt(v), the scales and codes.
void CompactPackRangeAvx2(const float* w, const float* m, const float* v, const CompactState& s, size_t begin,
                          size_t end) {
  const Ints c;
  size_t i = begin;
  for (; i + kCompactBlock <= end; i += kCompactBlock) {
    __m256i hi[kVectors], lo[kVectors];
    __m256 mv[kVectors], rv[kVectors];
#pragma GCC unroll 4
    for (size_t k = 0; k < kVectors; ++k) {
      const size_t e = i + k * kAvx2Lanes;
      Split(c, _mm256_loadu_ps(w + e), &hi[k], &lo[k]);
      mv[k] = _mm256_loadu_ps(m + e);
      if (v) rv[k] = SaturateRoot(c, _mm256_sqrt_ps(_mm256_loadu_ps(v + e)));
    }
    Store32(s.w_hi + i, _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[0], hi[1]), 0xd8));
    Store32(s.w_hi + i + 16, _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[2], hi[3]), 0xd8));
    Store32(s.w_lo + i, PackBytes(c, lo, true));
    StoreMoments(c, s, i, mv, v ? rv : nullptr);
  }
  if (i < end) CompactPackRange(w, m, v, s, i, end);
}

// CompactUnpackRange's operations in vectors (Rebuild, DequantizeM/V); the
// last partial vector by the scalar reference.
void CompactUnpackRangeAvx2(const CompactState& s, float* w, float* m, float* v, size_t begin, size_t end) {
  const Ints c;
  size_t i = begin;
  for (; i + kAvx2Lanes <= end; i += kAvx2Lanes) {
    const size_t b = i / kCompactBlock;  // a vector never straddles two blocks
    _mm256_storeu_ps(w + i, Rebuild(c, s.w_hi + i, s.w_lo + i));
    _mm256_storeu_ps(m + i, DequantizeM(s.m_code + i, _mm256_set1_ps(s.m_scale[b] / kMCodeSquared)));
    if (v) _mm256_storeu_ps(v + i, DequantizeV(s.v_code + i, _mm256_set1_ps(s.v_scale[b] / kVCodeSquared)));
  }
  if (i < end) CompactUnpackRange(s, w, m, v, i, end);
}

CompactLionRangeFn SelectCompactLionAvx2(DType grad, CompactCopy copy) {
  return PickCompactLion<CompactLionAvx2>(grad, copy);
}

CompactAdamRangeFn SelectCompactAdamAvx2(DType grad, CompactCopy copy, bool l2, bool lerp) {
  return PickCompactAdam<CompactAdamAvx2>(grad, copy, l2, lerp);
}

}  // namespace strata::kernels::internal
