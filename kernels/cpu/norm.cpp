// Sum-of-squares entry points: one fp64 partial per fixed tile, partials added
// in tile order, so the result is the same for any thread count.
#include "kernels/cpu/norm.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/range_kernels.h"

namespace strata::kernels {

namespace {

internal::SumSquaresRangeFn RangeFn(CpuIsa isa, DType dtype) {
  if (isa == CpuIsa::kAvx2) return internal::SelectSumSquaresAvx2(dtype);
  if (isa == CpuIsa::kAvx512) return internal::SelectSumSquaresAvx512(dtype);
  return internal::SelectSumSquaresScalar(dtype);
}

}  // namespace

SquaresSum JoinTiles(const double* partials, size_t tiles) {
  double sum = 0.0;
  for (size_t k = 0; k < tiles; ++k) sum += partials[k];
  SquaresSum out;
  out.sum_squares = sum;
  out.all_finite = std::isfinite(sum);  // see norm.h: finite inputs give a finite sum
  return out;
}

Status SumSquaresOn(CpuIsa isa, DType dtype, const void* x, size_t n, SquaresSum* out) {
  STRATA_RETURN_IF_ERROR(CheckCpuIsa(isa));
  if (out == nullptr || (x == nullptr && n > 0)) return InvalidError("SumSquares: null pointer");
  const internal::SumSquaresRangeFn fn = RangeFn(isa, dtype);
  std::vector<double> partial((n + kReduceTile - 1) / kReduceTile, 0.0);
  ParallelForTiles(n, kReduceTile,
                   [&](size_t begin, size_t end) { partial[begin / kReduceTile] = fn(x, begin, end); });
  *out = JoinTiles(partial.data(), partial.size());
  return Status::Ok();
}

Status TileSquares(DType dtype, const void* x, size_t n, double* partials) {
  if ((x == nullptr || partials == nullptr) && n > 0) return InvalidError("TileSquares: null pointer");
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  const internal::SumSquaresRangeFn fn = RangeFn(isa, dtype);
  ParallelForTiles(n, kReduceTile,
                   [&](size_t begin, size_t end) { partials[begin / kReduceTile] = fn(x, begin, end); });
  return Status::Ok();
}

Status CopyTileSquares(DType dtype, const void* src, void* dst, size_t n, double* partials) {
  if ((src == nullptr || dst == nullptr || partials == nullptr) && n > 0)
    return InvalidError("CopyTileSquares: null pointer");
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  const internal::SumSquaresRangeFn fn = RangeFn(isa, dtype);
  const size_t size = DTypeSize(dtype);
  ParallelForTiles(n, kReduceTile, [&](size_t begin, size_t end) {
    std::memcpy(static_cast<char*>(dst) + begin * size, static_cast<const char*>(src) + begin * size,
                (end - begin) * size);
    partials[begin / kReduceTile] = fn(dst, begin, end);
  });
  return Status::Ok();
}

Status SumSquares(DType dtype, const void* x, size_t n, SquaresSum* out) {
  STRATA_ASSIGN_OR_RETURN(const CpuIsa isa, ActiveCpuIsa());
  return SumSquaresOn(isa, dtype, x, n, out);
}

}  // namespace strata::kernels
