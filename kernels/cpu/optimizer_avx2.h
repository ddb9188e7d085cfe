// Internal: what the AVX2 optimizer kernels share (Adam's and Lion's
// broadcast step constants, the correctly rounded division by sqrt_bc2,
// Lion's sign), for the fp32-state kernels and the compact ones alike. In an
// anonymous namespace, as variant_select.h: included only by files compiled
// with the AVX2 flags.
#pragma once

#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/step_scalars.h"

namespace strata::kernels::internal {
namespace {

struct AdamConstsx8 {
  explicit AdamConstsx8(const AdamStepScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)), l2(_mm256_set1_ps(s.l2)),
        decay(_mm256_set1_ps(s.decay)), beta1(_mm256_set1_ps(s.beta1)),
        one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)), beta2(_mm256_set1_ps(s.beta2)),
        one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        sqrt_bc2(_mm256_set1_ps(s.sqrt_bc2)), inv_sqrt_bc2(_mm256_set1_ps(s.inv_sqrt_bc2)), eps(_mm256_set1_ps(s.eps)),
        neg_step_size(_mm256_set1_ps(s.neg_step_size)), lerp_weight(_mm256_set1_ps(s.lerp_weight)),
        lerp_from_grad(_mm256_castsi256_ps(_mm256_set1_epi32(s.lerp_from_grad ? -1 : 0))) {}
  __m256 grad_scale, l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, inv_sqrt_bc2, eps,
      neg_step_size, lerp_weight;
  __m256 lerp_from_grad;  // all ones or all zeros: the lerp's base is g, else m
};

// Adam's new first moment from the old one and the gradient, as the scalar
// FirstMoment (scalar_elements.h): the same FMA, the base picked exactly.
template <bool kLerp>
inline __m256 FirstMoment(const AdamConstsx8& k, __m256 m, __m256 g) {
  if constexpr (kLerp)
    return _mm256_fmadd_ps(k.lerp_weight, _mm256_sub_ps(g, m), _mm256_blendv_ps(m, g, k.lerp_from_grad));
  return _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(m, k.beta1));
}

// x / sqrt_bc2 correctly rounded without vdivps (see step_scalars.h). x is
// sqrt(v) >= 0 or NaN; x = inf keeps q0 = inf (the FMA residual would be NaN).
inline __m256 DivideBySqrtBc2(const AdamConstsx8& k, __m256 x) {
  const __m256 q0 = _mm256_mul_ps(x, k.inv_sqrt_bc2);
  const __m256 r = _mm256_fnmadd_ps(q0, k.sqrt_bc2, x);  // x - q0*c, exact
  const __m256 q1 = _mm256_fmadd_ps(r, k.inv_sqrt_bc2, q0);
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  return _mm256_blendv_ps(q1, q0, _mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
}

struct LionConstsx8 {
  explicit LionConstsx8(const LionStepScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)), decay(_mm256_set1_ps(s.decay)),
        beta1(_mm256_set1_ps(s.beta1)), one_minus_beta1(_mm256_set1_ps(s.one_minus_beta1)),
        beta2(_mm256_set1_ps(s.beta2)), one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        neg_lr(_mm256_set1_ps(s.neg_lr)) {}
  __m256 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
};

// +1, -1, +0 for ±0, and c itself for NaN, as LionSign in lion_scalar.cpp.
inline __m256 Sign(__m256 c) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 s = _mm256_blendv_ps(c, zero, _mm256_cmp_ps(c, zero, _CMP_EQ_OQ));
  s = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_cmp_ps(c, zero, _CMP_GT_OQ));
  return _mm256_blendv_ps(s, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(c, zero, _CMP_LT_OQ));
}

}  // namespace
}  // namespace strata::kernels::internal
