// AVX2 + F16C path of the casts, bitwise equal to cast_scalar.cpp.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType S, DType D>
void CastAvx2(const void* src, void* dst, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + kAvx2Lanes <= end; i += kAvx2Lanes)
    StoreFromF32x8<D>(dst, i, LoadAsF32x8<S>(src, i));
  if (i == end) return;
  TailBuffers<kAvx2Lanes> t;
  t.Take(t.in, src, i, end - i, DTypeSize(S));
  StoreFromF32x8<D>(t.out, 0, LoadAsF32x8<S>(t.in, 0));
  t.Give(dst, t.out, i, end - i, DTypeSize(D));
}

}  // namespace

CastRangeFn SelectCastAvx2(DType src, DType dst) {
  return WithDType(src, [&](auto s) {
    return WithDType(dst, [](auto d) -> CastRangeFn { return &CastAvx2<decltype(s)::value, decltype(d)::value>; });
  });
}

}  // namespace strata::kernels::internal
