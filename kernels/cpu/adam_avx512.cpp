// AVX-512 path of Adam/AdamW: 16 lanes, the scalar reference's operations in
// the same order with the same FMAs, so results are bitwise equal.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx512.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool kL2, bool kLerp, bool kBf16Insn>
struct AdamAvx512 {
  static void Block(const AdamConstsx16& k, const AdamArrays& a, size_t i) {
    __m512 g = _mm512_mul_ps(LoadAsF32x16<G>(a.grad, i), k.grad_scale);
    __m512 p = _mm512_loadu_ps(a.param + i);
    if constexpr (kL2) g = _mm512_fmadd_ps(p, k.l2, g);
    p = _mm512_mul_ps(p, k.decay);
    const __m512 m = FirstMoment<kLerp>(k, _mm512_loadu_ps(a.exp_avg + i), g);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(k.one_minus_beta2, g), g,
                                     _mm512_mul_ps(_mm512_loadu_ps(a.exp_avg_sq + i), k.beta2));
    const __m512 denom = _mm512_add_ps(DivideBySqrtBc2(k, _mm512_sqrt_ps(v)), k.eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.neg_step_size, m), denom));
    _mm512_storeu_ps(a.param + i, p);
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
    StoreCopyx16<C, kBf16Insn>(a.param_copy, i, p);
  }

  static void Run(const AdamStepScalars& s, const AdamArrays& a, size_t begin, size_t end) {
    const AdamConstsx16 k(s);
    size_t i = begin;
    // Local copies: the compiler cannot prove that stores through the float
    // arrays leave `a` unchanged, and would reload every pointer per block.
    const AdamArrays local = a;
    for (; i + kAvx512Lanes <= end; i += kAvx512Lanes) {
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.exp_avg, local.exp_avg_sq);
      Block(k, local, i);
    }
    if (i == end) return;
    static constexpr float* AdamArrays::*kStates[] = {&AdamArrays::param, &AdamArrays::exp_avg,
                                                      &AdamArrays::exp_avg_sq};
    RunTail<kAvx512Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, end - i,
                     [&](const AdamArrays& x) { Block(k, x, 0); });
  }
};

template <DType G, CopyOut C, bool kL2, bool kLerp>
using AdamAvx512Int = AdamAvx512<G, C, kL2, kLerp, false>;
template <DType G, CopyOut C, bool kL2, bool kLerp>
using AdamAvx512Bf16 = AdamAvx512<G, C, kL2, kLerp, true>;

}  // namespace

AdamRangeFn SelectAdamAvx512(DType grad, CopyOut copy, bool l2, bool lerp, bool bf16_insn) {
  if (bf16_insn && copy == CopyOut::kBF16) return PickVariant<AdamAvx512Bf16>(grad, copy, l2, lerp);
  return PickVariant<AdamAvx512Int>(grad, copy, l2, lerp);
}

}  // namespace strata::kernels::internal
