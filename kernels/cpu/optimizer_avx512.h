// Internal: what the AVX512 optimizer kernels share (Adam's and Lion's
// broadcast step constants, the correctly rounded division by sqrt_bc2,
// Lion's sign), for the fp32-state kernels and the compact ones alike. In an
// anonymous namespace, as variant_select.h: included only by files compiled
// with the AVX512 flags.
#pragma once

#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::internal {
namespace {

struct AdamConstsx16 {
  explicit AdamConstsx16(const AdamStepScalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)), l2(_mm512_set1_ps(s.l2)),
        decay(_mm512_set1_ps(s.decay)), beta1(_mm512_set1_ps(s.beta1)),
        one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)), beta2(_mm512_set1_ps(s.beta2)),
        one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        sqrt_bc2(_mm512_set1_ps(s.sqrt_bc2)), inv_sqrt_bc2(_mm512_set1_ps(s.inv_sqrt_bc2)), eps(_mm512_set1_ps(s.eps)),
        neg_step_size(_mm512_set1_ps(s.neg_step_size)), lerp_weight(_mm512_set1_ps(s.lerp_weight)),
        lerp_from_grad(s.lerp_from_grad ? __mmask16(0xffff) : __mmask16(0)) {}
  __m512 grad_scale, l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, inv_sqrt_bc2, eps,
      neg_step_size, lerp_weight;
  __mmask16 lerp_from_grad;  // all lanes or none: the lerp's base is g, else m
};

// Adam's new first moment from the old one and the gradient, as the scalar
// FirstMoment (scalar_elements.h): the same FMA, the base picked exactly.
template <bool kLerp>
inline __m512 FirstMoment(const AdamConstsx16& k, __m512 m, __m512 g) {
  if constexpr (kLerp)
    return _mm512_fmadd_ps(k.lerp_weight, _mm512_sub_ps(g, m), _mm512_mask_mov_ps(m, k.lerp_from_grad, g));
  return _mm512_fmadd_ps(k.one_minus_beta1, g, _mm512_mul_ps(m, k.beta1));
}

// x / sqrt_bc2 correctly rounded without vdivps (see step_scalars.h). x is
// sqrt(v) >= 0 or NaN; x = inf keeps q0 = inf (the FMA residual would be NaN).
inline __m512 DivideBySqrtBc2(const AdamConstsx16& k, __m512 x) {
  const __m512 q0 = _mm512_mul_ps(x, k.inv_sqrt_bc2);
  const __m512 r = _mm512_fnmadd_ps(q0, k.sqrt_bc2, x);  // x - q0*c, exact
  const __m512 q1 = _mm512_fmadd_ps(r, k.inv_sqrt_bc2, q0);
  const __mmask16 inf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(q1, inf, q0);
}

struct LionConstsx16 {
  explicit LionConstsx16(const LionStepScalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)), decay(_mm512_set1_ps(s.decay)),
        beta1(_mm512_set1_ps(s.beta1)), one_minus_beta1(_mm512_set1_ps(s.one_minus_beta1)),
        beta2(_mm512_set1_ps(s.beta2)), one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        neg_lr(_mm512_set1_ps(s.neg_lr)) {}
  __m512 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
};

// +1, -1, +0 for ±0, and c itself for NaN, as LionSign in lion_scalar.cpp.
inline __m512 Sign(__m512 c) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 s = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(c, zero, _CMP_EQ_OQ), zero);
  s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
  return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
}

}  // namespace
}  // namespace strata::kernels::internal
