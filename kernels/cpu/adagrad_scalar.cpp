// Scalar reference of Adagrad; the SIMD paths match it bit for bit.
#include <cmath>

#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool kL2>
struct AdagradScalar {
  static void Run(const AdagradStepScalars& s, const AdagradArrays& a, size_t begin,
                  size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float g = LoadAsF32<G>(a.grad, i) * s.grad_scale;
      float p = a.param[i];
      if constexpr (kL2) g = std::fma(p, s.weight_decay, g);
      const float sum = std::fma(g, g, a.state_sum[i]);
      p = std::fma(s.neg_clr, g / (std::sqrt(sum) + s.eps), p);
      a.param[i] = p;
      a.state_sum[i] = sum;
      StoreCopy<C>(a.param_copy, i, p);
    }
  }
};

}  // namespace

AdagradRangeFn SelectAdagradScalar(DType grad, CopyOut copy, bool l2) {
  return PickVariant<AdagradScalar>(grad, copy, l2);
}

}  // namespace strata::kernels::internal
