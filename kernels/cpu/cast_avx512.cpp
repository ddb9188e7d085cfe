// AVX-512 path of the casts, bitwise equal to cast_scalar.cpp.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"

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

template <DType S>
CastRangeFn PickDst(DType dst, bool bf16_insn) {
  switch (dst) {
    case DType::kBF16:
      return bf16_insn ? &CastAvx512<S, DType::kBF16, true> : &CastAvx512<S, DType::kBF16, false>;
    case DType::kF16: return &CastAvx512<S, DType::kF16, false>;
    case DType::kF32: break;
  }
  return &CastAvx512<S, DType::kF32, false>;
}

}  // namespace

CastRangeFn SelectCastAvx512(DType src, DType dst, bool bf16_insn) {
  switch (src) {
    case DType::kBF16: return PickDst<DType::kBF16>(dst, bf16_insn);
    case DType::kF16: return PickDst<DType::kF16>(dst, bf16_insn);
    case DType::kF32: break;
  }
  return PickDst<DType::kF32>(dst, bf16_insn);
}

}  // namespace strata::kernels::internal
