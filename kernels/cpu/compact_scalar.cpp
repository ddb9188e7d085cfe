// Scalar reference of the compact state: pack, unpack and the fused Adam/AdamW
// step, block by block. The SIMD paths match it bit for bit; the update is
// adam_scalar.cpp's arithmetic on the dequantized values.
#include <cmath>

#include "kernels/cpu/compact_elements.h"
#include "kernels/cpu/compact_kernels.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/scalar_elements.h"

namespace strata::kernels::internal {
namespace {

template <CompactCopy C>
inline void StoreCompactCopy(void* copy, size_t i, float p, uint16_t hi) {
  if constexpr (C == CompactCopy::kBF16) static_cast<uint16_t*>(copy)[i] = hi;
  if constexpr (C == CompactCopy::kF16) StoreFromF32<DType::kF16>(copy, i, p);
  if constexpr (C == CompactCopy::kF32) StoreFromF32<DType::kF32>(copy, i, p);
}

// Quantizes a block's new moments (m, r = sqrt(v)) into block b of s.
inline void StoreMoments(const CompactState& s, size_t i, size_t len, const float* m, const float* r) {
  const size_t b = i / kCompactBlock;
  s.m_scale[b] = QuantizeM(m, len, s.m_code + i);
  s.v_scale[b] = QuantizeV(r, len, s.v_code + i);
  ZeroMWhereVZero(s.v_code + i, s.m_code + i, len);
}

template <DType G, CompactCopy C, bool kL2, bool kLerp>
struct CompactAdamScalar {
  // The block of len (<= kCompactBlock) elements at i.
  static void Block(const AdamStepScalars& s, const CompactArrays& a, size_t i, size_t len) {
    const size_t b = i / kCompactBlock;
    const float m_step = MStep(a.s.m_scale[b]), v_step = VStep(a.s.v_scale[b]);
    float new_m[kCompactBlock], new_r[kCompactBlock];
    for (size_t j = 0; j < len; ++j) {
      const size_t e = i + j;
      float g = LoadAsF32<G>(a.grad, e) * s.grad_scale;
      float p = Rebuild(a.s.w_hi[e], a.s.w_lo[e]);
      if constexpr (kL2) g = std::fma(p, s.l2, g);
      p = p * s.decay;
      const float m = FirstMoment<kLerp>(s, DequantizeM(a.s.m_code[e], m_step), g);
      const float v = std::fma(s.one_minus_beta2 * g, g, DequantizeV(a.s.v_code[e], v_step) * s.beta2);
      const float r = std::sqrt(v);
      const float denom = r / s.sqrt_bc2 + s.eps;
      p = p + (s.neg_step_size * m) / denom;  // torch addcdiv_ order, as AdamScalar
      const SplitMaster w = Split(p);
      a.s.w_hi[e] = w.hi;
      a.s.w_lo[e] = w.lo;
      StoreCompactCopy<C>(a.param_copy, e, p, w.hi);
      new_m[j] = m;
      new_r[j] = SaturateRoot(r);
    }
    StoreMoments(a.s, i, len, new_m, new_r);
  }

  static void Run(const AdamStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    for (size_t i = begin; i < end; i += kCompactBlock) Block(s, a, i, std::min(kCompactBlock, end - i));
  }
};

// +1, -1, 0 for ±0, and c itself for NaN, as LionSign in lion_scalar.cpp.
inline float LionSign(float c) {
  if (c > 0) return 1.0f;
  if (c < 0) return -1.0f;
  return c == 0 ? 0.0f : c;
}

template <DType G, CompactCopy C>
struct CompactLionScalar {
  static void Run(const LionStepScalars& s, const CompactArrays& a, size_t begin, size_t end) {
    float new_m[kCompactBlock];
    for (size_t i = begin; i < end; i += kCompactBlock) {
      const size_t len = std::min(kCompactBlock, end - i);
      const float m_step = MStep(a.s.m_scale[i / kCompactBlock]);
      for (size_t j = 0; j < len; ++j) {
        const size_t e = i + j;
        const float g = LoadAsF32<G>(a.grad, e) * s.grad_scale;
        const float m = DequantizeM(a.s.m_code[e], m_step);
        float p = Rebuild(a.s.w_hi[e], a.s.w_lo[e]) * s.decay;
        const float c = std::fma(s.one_minus_beta1, g, m * s.beta1);
        p = std::fma(s.neg_lr, LionSign(c), p);
        const SplitMaster w = Split(p);
        a.s.w_hi[e] = w.hi;
        a.s.w_lo[e] = w.lo;
        StoreCompactCopy<C>(a.param_copy, e, p, w.hi);
        new_m[j] = std::fma(s.one_minus_beta2, g, m * s.beta2);
      }
      a.s.m_scale[i / kCompactBlock] = QuantizeM(new_m, len, a.s.m_code + i);
    }
  }
};

}  // namespace

CompactAdamRangeFn SelectCompactAdamScalar(DType grad, CompactCopy copy, bool l2, bool lerp) {
  return PickCompactAdam<CompactAdamScalar>(grad, copy, l2, lerp);
}

CompactLionRangeFn SelectCompactLionScalar(DType grad, CompactCopy copy) {
  return PickCompactLion<CompactLionScalar>(grad, copy);
}

void CompactPackRange(const float* w, const float* m, const float* v, const CompactState& s, size_t begin,
                      size_t end) {
  float r[kCompactBlock];
  for (size_t i = begin; i < end; i += kCompactBlock) {
    const size_t len = std::min(kCompactBlock, end - i);
    for (size_t j = 0; j < len; ++j) {
      const SplitMaster sp = Split(w[i + j]);
      s.w_hi[i + j] = sp.hi;
      s.w_lo[i + j] = sp.lo;
      if (v) r[j] = SaturateRoot(std::sqrt(v[i + j]));
    }
    if (v) {
      StoreMoments(s, i, len, m + i, r);
    } else {
      s.m_scale[i / kCompactBlock] = QuantizeM(m + i, len, s.m_code + i);  // Lion: no v
    }
  }
}

void CompactUnpackRange(const CompactState& s, float* w, float* m, float* v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const size_t b = i / kCompactBlock;
    w[i] = Rebuild(s.w_hi[i], s.w_lo[i]);
    m[i] = DequantizeM(s.m_code[i], MStep(s.m_scale[b]));
    if (v) v[i] = DequantizeV(s.v_code[i], VStep(s.v_scale[b]));
  }
}

}  // namespace strata::kernels::internal
