// Scalar reference of Lion; the SIMD paths match it bit for bit.
#include <cmath>

#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

// +1, -1, 0 for ±0, and c itself for NaN (so a NaN update stays visible).
inline float LionSign(float c) {
  if (c > 0) return 1.0f;
  if (c < 0) return -1.0f;
  return c == 0 ? 0.0f : c;
}

template <DType G, CopyOut C, bool>
struct LionScalar {
  static void Run(const LionStepScalars& s, const LionArrays& a, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const float g = LoadAsF32<G>(a.grad, i) * s.grad_scale;
      const float m = a.exp_avg[i];
      float p = a.param[i] * s.decay;
      const float c = std::fma(s.one_minus_beta1, g, m * s.beta1);
      p = std::fma(s.neg_lr, LionSign(c), p);
      a.param[i] = p;
      a.exp_avg[i] = std::fma(s.one_minus_beta2, g, m * s.beta2);
      StoreCopy<C>(a.param_copy, i, p);
    }
  }
};

}  // namespace

LionRangeFn SelectLionScalar(DType grad, CopyOut copy) {
  return PickVariant<LionScalar>(grad, copy, false);
}

}  // namespace strata::kernels::internal
