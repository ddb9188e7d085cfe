// AVX-512 path of Lion, bitwise equal to lion_scalar.cpp.
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"
#include "kernels/cpu/optimizer_avx512.h"

namespace strata::kernels::internal {
namespace {

template <DType G, CopyOut C, bool kBf16Insn>
struct LionAvx512 {
  static void Block(const LionConstsx16& k, const LionArrays& a, size_t i) {
    const __m512 g = _mm512_mul_ps(LoadAsF32x16<G>(a.grad, i), k.grad_scale);
    const __m512 m = _mm512_loadu_ps(a.exp_avg + i);
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a.param + i), k.decay);
    const __m512 c = _mm512_fmadd_ps(k.one_minus_beta1, g, _mm512_mul_ps(m, k.beta1));
    p = _mm512_fmadd_ps(k.neg_lr, Sign(c), p);
    _mm512_storeu_ps(a.param + i, p);
    _mm512_storeu_ps(a.exp_avg + i, _mm512_fmadd_ps(k.one_minus_beta2, g, _mm512_mul_ps(m, k.beta2)));
    StoreCopyx16<C, kBf16Insn>(a.param_copy, i, p);
  }

  static void Run(const LionStepScalars& s, const LionArrays& a, size_t begin, size_t end) {
    const LionConstsx16 k(s);
    size_t i = begin;
    const LionArrays local = a;  // the compiler cannot prove the stores leave `a` unchanged
    for (; i + kAvx512Lanes <= end; i += kAvx512Lanes) {
      PrefetchStreams(i + kPrefetchAhead, local.grad, DTypeSize(G), local.param, local.exp_avg);
      Block(k, local, i);
    }
    if (i == end) return;
    static constexpr float* LionArrays::*kStates[] = {&LionArrays::param, &LionArrays::exp_avg};
    RunTail<kAvx512Lanes>(a, kStates, DTypeSize(G), C != CopyOut::kNone ? 2 : 0, i, end - i,
                     [&](const LionArrays& x) { Block(k, x, 0); });
  }
};

}  // namespace

LionRangeFn SelectLionAvx512(DType grad, CopyOut copy, bool bf16_insn) {
  return PickVariant<LionAvx512>(grad, copy, bf16_insn && copy == CopyOut::kBF16);
}

}  // namespace strata::kernels::internal
