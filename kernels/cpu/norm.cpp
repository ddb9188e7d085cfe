// Sum-of-squares entry points: one fp64 partial per fixed tile, partials added
// in tile order, so the result is the same for any thread count.
#include "kernels/cpu/norm.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"

namespace strata::kernels {

Status SumSquaresOn(CpuIsa isa, DType dtype, const void* x, size_t n, SquaresSum* out) {
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (out == nullptr || (x == nullptr && n > 0)) return InvalidError("SumSquares: null pointer");
  internal::SumSquaresRangeFn fn = internal::SelectSumSquaresScalar(dtype);
  if (isa == CpuIsa::kAvx2) fn = internal::SelectSumSquaresAvx2(dtype);
  if (isa == CpuIsa::kAvx512) fn = internal::SelectSumSquaresAvx512(dtype);
  std::vector<double> partial((n + kReduceTile - 1) / kReduceTile, 0.0);
  ParallelForTiles(n, kReduceTile,
                   [&](size_t begin, size_t end) { partial[begin / kReduceTile] = fn(x, begin, end); });
  double sum = 0.0;
  for (const double p : partial) sum += p;
  out->sum_squares = sum;
  out->all_finite = std::isfinite(sum);  // see norm.h: finite inputs give a finite sum
  return Status::Ok();
}

Status SumSquares(DType dtype, const void* x, size_t n, SquaresSum* out) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return SumSquaresOn(isa, dtype, x, n, out);
}

}  // namespace strata::kernels
