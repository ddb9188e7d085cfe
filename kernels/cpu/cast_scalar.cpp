// Scalar reference of the casts: base/dtype.h's conversions element by element.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType S, DType D>
void CastScalar(const void* src, void* dst, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) StoreFromF32<D>(dst, i, LoadAsF32<S>(src, i));
}

}  // namespace

CastRangeFn SelectCastScalar(DType src, DType dst) {
  return WithDType(src, [&](auto s) {
    return WithDType(dst, [](auto d) -> CastRangeFn { return &CastScalar<decltype(s)::value, decltype(d)::value>; });
  });
}

}  // namespace strata::kernels::internal
