// AVX2 + FMA path of Adagrad, bitwise equal to adagrad_scalar.cpp.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

struct AdagradConstsx8 {
  explicit AdagradConstsx8(const AdagradStepScalars& s)
      : grad_scale(_mm256_set1_ps(s.grad_scale)), weight_decay(_mm256_set1_ps(s.weight_decay)),
        eps(_mm256_set1_ps(s.eps)), neg_clr(_mm256_set1_ps(s.neg_clr)) {}
  __m256 grad_scale, weight_decay, eps, neg_clr;
};

template <DType G, CopyOut C, bool kL2>
struct AdagradAvx2 {
  static void Block(const AdagradConstsx8& k, const AdagradArrays& a, size_t i) {
    __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, i), k.grad_scale);
    __m256 p = _mm256_loadu_ps(a.param + i);
    if constexpr (kL2) g = _mm256_fmadd_ps(p, k.weight_decay, g);
    const __m256 sum = _mm256_fmadd_ps(g, g, _mm256_loadu_ps(a.state_sum + i));
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(sum), k.eps);
    p = _mm256_fmadd_ps(k.neg_clr, _mm256_div_ps(g, denom), p);
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.state_sum + i, sum);
    StoreCopyx8<C>(a.param_copy, i, p);
  }

  static void Run(const AdagradStepScalars& s, const AdagradArrays& a, size_t begin,
                  size_t end) {
    const AdagradConstsx8 k(s);
    size_t i = begin;
    const AdagradArrays local = a;  // the compiler cannot prove the stores leave `a` unchanged
    for (; i + 2 * kAvx2Lanes <= end; i += 2 * kAvx2Lanes) {  // 16 floats: one line of each stream
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.state_sum);
      Block(k, local, i);
      Block(k, local, i + kAvx2Lanes);
    }
    for (; i + kAvx2Lanes <= end; i += kAvx2Lanes) Block(k, local, i);
    if (i == end) return;
    static constexpr float* AdagradArrays::*kStates[] = {&AdagradArrays::param, &AdagradArrays::state_sum};
    RunTail<kAvx2Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, end - i,
                     [&](const AdagradArrays& x) { Block(k, x, 0); });
  }
};

}  // namespace

AdagradRangeFn SelectAdagradAvx2(DType grad, CopyOut copy, bool l2) {
  return PickVariant<AdagradAvx2>(grad, copy, l2);
}

}  // namespace strata::kernels::internal
