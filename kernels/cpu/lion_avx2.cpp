// AVX2 + FMA path of Lion, bitwise equal to lion_scalar.cpp.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx2.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool>
struct LionAvx2 {
  static void Block(const LionConstsx8& k, const LionArrays& a, size_t i) {
    const __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, i), k.grad_scale);
    const __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.param + i), k.decay);
    const __m256 c = _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(m, k.beta1));
    p = _mm256_fmadd_ps(k.neg_lr, Sign(c), p);
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.exp_avg + i, _mm256_fmadd_ps(k.one_minus_beta2, g, _mm256_mul_ps(m, k.beta2)));
    StoreCopyx8<C>(a.param_copy, i, p);
  }

  static void Run(const LionStepScalars& s, const LionArrays& a, size_t begin, size_t end) {
    const LionConstsx8 k(s);
    size_t i = begin;
    const LionArrays local = a;  // the compiler cannot prove the stores leave `a` unchanged
    for (; i + 2 * kAvx2Lanes <= end; i += 2 * kAvx2Lanes) {  // 16 floats: one line of each stream
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.exp_avg);
      Block(k, local, i);
      Block(k, local, i + kAvx2Lanes);
    }
    for (; i + kAvx2Lanes <= end; i += kAvx2Lanes) Block(k, local, i);
    if (i == end) return;
    static constexpr float* LionArrays::*kStates[] = {&LionArrays::param, &LionArrays::exp_avg};
    RunTail<kAvx2Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, end - i,
                     [&](const LionArrays& x) { Block(k, x, 0); });
  }
};

}  // namespace

LionRangeFn SelectLionAvx2(DType grad, CopyOut copy) {
  return PickVariant<LionAvx2>(grad, copy, false);
}

}  // namespace strata::kernels::internal
