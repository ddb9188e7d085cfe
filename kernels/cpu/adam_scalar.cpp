// Scalar reference of Adam/AdamW: the oracle the SIMD and CUDA paths must
// match bit for bit. The operation order is the one in step_scalars.h.
#include <cmath>

#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool kL2, bool kLerp>
struct AdamScalar {
  static void Run(const AdamStepScalars& s, const AdamArrays& a, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float g = LoadAsF32<G>(a.grad, i) * s.grad_scale;
      float p = a.param[i];
      if constexpr (kL2) g = std::fma(p, s.l2, g);
      p = p * s.decay;
      const float m = FirstMoment<kLerp>(s, a.exp_avg[i], g);
      const float v = std::fma(s.one_minus_beta2 * g, g, a.exp_avg_sq[i] * s.beta2);
      const float denom = std::sqrt(v) / s.sqrt_bc2 + s.eps;
      p = p + (s.neg_step_size * m) / denom;  // torch addcdiv_ order
      a.param[i] = p;
      a.exp_avg[i] = m;
      a.exp_avg_sq[i] = v;
      StoreCopy<C>(a.param_copy, i, p);
    }
  }
};

}  // namespace

AdamRangeFn SelectAdamScalar(DType grad, CopyOut copy, bool l2, bool lerp) {
  return PickVariant<AdamScalar>(grad, copy, l2, lerp);
}

}  // namespace strata::kernels::internal
