// AVX-512 path of the casts, bitwise equal to cast_scalar.cpp.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType S, DType D, bool kBf16Insn>
void CastAvx512(const void* src, void* dst, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + kAvx512Lanes <= end; i += kAvx512Lanes)
    StoreFromF32x16<D, kBf16Insn>(dst, i, LoadAsF32x16<S>(src, i));
  if (i == end) return;
  TailBuffers<kAvx512Lanes> t;
  t.Take(t.in, src, i, end - i, DTypeSize(S));
  StoreFromF32x16<D, kBf16Insn>(t.out, 0, LoadAsF32x16<S>(t.in, 0));
  t.Give(dst, t.out, i, end - i, DTypeSize(D));
}

}  // namespace

CastRangeFn SelectCastAvx512(DType src, DType dst, bool bf16_insn) {
  // The AVX512-BF16 instruction matters only for a bf16 destination.
  const bool insn = bf16_insn && dst == DType::kBF16;
  return WithDType(src, [&](auto s) {
    return WithDType(dst, [&](auto d) -> CastRangeFn {
      constexpr DType S = decltype(s)::value, D = decltype(d)::value;
      return insn ? &CastAvx512<S, D, true> : &CastAvx512<S, D, false>;
    });
  });
}

}  // namespace strata::kernels::internal
