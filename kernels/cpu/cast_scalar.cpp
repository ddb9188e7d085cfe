// Scalar reference of the casts: base/dtype.h's conversions element by element.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"

namespace strata::kernels::internal {
namespace {

template <DType S, DType D>
void CastScalar(const void* src, void* dst, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) StoreFromF32<D>(dst, i, LoadAsF32<S>(src, i));
}

template <DType S>
CastRangeFn PickDst(DType dst) {
  switch (dst) {
    case DType::kBF16: return &CastScalar<S, DType::kBF16>;
    case DType::kF16: return &CastScalar<S, DType::kF16>;
    case DType::kF32: break;
  }
  return &CastScalar<S, DType::kF32>;
}

}  // namespace

CastRangeFn SelectCastScalar(DType src, DType dst) {
  switch (src) {
    case DType::kBF16: return PickDst<DType::kBF16>(dst);
    case DType::kF16: return PickDst<DType::kF16>(dst);
    case DType::kF32: break;
  }
  return PickDst<DType::kF32>(dst);
}

}  // namespace strata::kernels::internal
