// AVX2 + FMA path of Adam/AdamW: 8 lanes, the scalar reference's operations in
// the same order with the same FMAs, so results are bitwise equal.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx2.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool kL2, bool kLerp>
struct AdamAvx2 {
  static void Block(const AdamConstsx8& k, const AdamArrays& a, size_t i) {
    StoreCopyx8<C>(a.param_copy, i, Update(k, a, i));
  }

  // Updates param, exp_avg, exp_avg_sq at [i, i+8); returns the new param.
  static __m256 Update(const AdamConstsx8& k, const AdamArrays& a, size_t i) {
    __m256 g = _mm256_mul_ps(LoadAsF32x8<G>(a.grad, i), k.grad_scale);
    __m256 p = _mm256_loadu_ps(a.param + i);
    if constexpr (kL2) g = _mm256_fmadd_ps(p, k.l2, g);
    p = _mm256_mul_ps(p, k.decay);
    const __m256 m = FirstMoment<kLerp>(k, _mm256_loadu_ps(a.exp_avg + i), g);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, g), g,
                                     _mm256_mul_ps(_mm256_loadu_ps(a.exp_avg_sq + i), k.beta2));
    const __m256 denom = _mm256_add_ps(DivideBySqrtBc2(k, _mm256_sqrt_ps(v)), k.eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m), denom));
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    return p;
  }

  static void Run(const AdamStepScalars& s, const AdamArrays& a, size_t begin, size_t end) {
    const AdamConstsx8 k(s);
    size_t i = begin;
    // Local copies: the compiler cannot prove that stores through the float
    // arrays leave `a` unchanged, and would reload every pointer per block.
    const AdamArrays local = a;
    for (; i + 2 * kAvx2Lanes <= end; i += 2 * kAvx2Lanes) {
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.exp_avg, local.exp_avg_sq);
      const __m256 p0 = Update(k, local, i);
      const __m256 p1 = Update(k, local, i + kAvx2Lanes);
      StoreCopyx16<C>(local.param_copy, i, p0, p1);
    }
    for (; i + kAvx2Lanes <= end; i += kAvx2Lanes) Block(k, local, i);
    if (i < end) Tail(k, a, i, end - i);
  }

  static void Tail(const AdamConstsx8& k, const AdamArrays& a, size_t i, size_t r) {
    static constexpr float* AdamArrays::*kStates[] = {&AdamArrays::param, &AdamArrays::exp_avg, &AdamArrays::exp_avg_sq};
    RunTail<kAvx2Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, r,
                     [&](const AdamArrays& x) { Block(k, x, 0); });
  }
};

}  // namespace

AdamRangeFn SelectAdamAvx2(DType grad, CopyOut copy, bool l2, bool lerp) {
  return PickVariant<AdamAvx2>(grad, copy, l2, lerp);
}

}  // namespace strata::kernels::internal
