// AVX-512 path of Adagrad, bitwise equal to adagrad_scalar.cpp.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

struct AdagradConstsx16 {
  explicit AdagradConstsx16(const AdagradStepScalars& s)
      : grad_scale(_mm512_set1_ps(s.grad_scale)), weight_decay(_mm512_set1_ps(s.weight_decay)),
        eps(_mm512_set1_ps(s.eps)), neg_clr(_mm512_set1_ps(s.neg_clr)) {}
  __m512 grad_scale, weight_decay, eps, neg_clr;
};

template <DType G, CopyOut C, bool kL2, bool kBf16Insn>
struct AdagradAvx512 {
  static void Block(const AdagradConstsx16& k, const AdagradArrays& a, size_t i) {
    __m512 g = _mm512_mul_ps(LoadAsF32x16<G>(a.grad, i), k.grad_scale);
    __m512 p = _mm512_loadu_ps(a.param + i);
    if constexpr (kL2) g = _mm512_fmadd_ps(p, k.weight_decay, g);
    const __m512 sum = _mm512_fmadd_ps(g, g, _mm512_loadu_ps(a.state_sum + i));
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(sum), k.eps);
    p = _mm512_fmadd_ps(k.neg_clr, _mm512_div_ps(g, denom), p);
    _mm512_storeu_ps(a.param + i, p);
    _mm512_storeu_ps(a.state_sum + i, sum);
    StoreCopyx16<C, kBf16Insn>(a.param_copy, i, p);
  }

  static void Run(const AdagradStepScalars& s, const AdagradArrays& a, size_t begin,
                  size_t end) {
    const AdagradConstsx16 k(s);
    size_t i = begin;
    const AdagradArrays local = a;  // the compiler cannot prove the stores leave `a` unchanged
    for (; i + kAvx512Lanes <= end; i += kAvx512Lanes) {
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.state_sum);
      Block(k, local, i);
    }
    if (i == end) return;
    static constexpr float* AdagradArrays::*kStates[] = {&AdagradArrays::param, &AdagradArrays::state_sum};
    RunTail<kAvx512Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, end - i,
                     [&](const AdagradArrays& x) { Block(k, x, 0); });
  }
};

template <DType G, CopyOut C, bool kL2>
using AdagradAvx512Int = AdagradAvx512<G, C, kL2, false>;
template <DType G, CopyOut C, bool kL2>
using AdagradAvx512Bf16 = AdagradAvx512<G, C, kL2, true>;

}  // namespace

AdagradRangeFn SelectAdagradAvx512(DType grad, CopyOut copy, bool l2, bool bf16_insn) {
  if (bf16_insn && copy == CopyOut::kBF16) return PickVariant<AdagradAvx512Bf16>(grad, copy, l2);
  return PickVariant<AdagradAvx512Int>(grad, copy, l2);
}

}  // namespace strata::kernels::internal
