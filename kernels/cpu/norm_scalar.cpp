// Scalar reference of the sum of squares: 16 interleaved fp64 lanes joined as
// a fixed tree, the order the SIMD paths reproduce.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/scalar_elements.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

template <DType D>
double SumSquaresScalar(const void* x, size_t begin, size_t end) {
  double lane[16] = {};
  for (size_t i = begin; i < end; ++i) {
    const double f = LoadAsF32<D>(x, i);
    lane[(i - begin) % 16] += f * f;
  }
  for (int half = 8; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) lane[j] += lane[j + half];
  return lane[0];
}

}  // namespace

SumSquaresRangeFn SelectSumSquaresScalar(DType dtype) {
  return WithDType(dtype, [](auto d) -> SumSquaresRangeFn { return &SumSquaresScalar<decltype(d)::value>; });
}

}  // namespace strata::kernels::internal
