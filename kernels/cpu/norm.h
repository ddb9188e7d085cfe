// Sum of squares of a gradient with fp64 accumulation, fused with the
// non-finite check: the input of global-norm clipping and of fp16 overflow
// detection (skip the step when !all_finite).
#pragma once

#include <cstddef>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/cpu/isa.h"

namespace strata::kernels {

struct SquaresSum {
  double sum_squares = 0;  // sum of x*x in fp64 (x*x of a float is exact in fp64)
  bool all_finite = true;  // false when any element is NaN or ±Inf
};

// x: n elements of `dtype`. Deterministic: fixed tiles of kReduceTile elements,
// each summed in 16 interleaved fp64 lanes (element i into lane i % 16, lanes
// joined as a fixed tree), tile partials added in tile order, whatever the
// thread count or path. Squares of finite floats are < 2^256, so the fp64 sum
// of any n < 2^64 of them stays finite: the sum is finite iff all inputs are,
// which makes the non-finite check free.
Status SumSquares(DType dtype, const void* x, size_t n, SquaresSum* out);
Status SumSquaresOn(CpuIsa isa, DType dtype, const void* x, size_t n, SquaresSum* out);

// SumSquares in its two halves, for a sum gathered a piece at a time (a
// group's gradients handed in parts): TileSquares writes the partial of
// every tile of x[0, n) (tile k: [k*kReduceTile, min(n, (k+1)*kReduceTile)))
// to partials[k]; JoinTiles adds `tiles` partials in tile order. Together
// they are SumSquares, bitwise.
Status TileSquares(DType dtype, const void* x, size_t n, double* partials);
SquaresSum JoinTiles(const double* partials, size_t tiles);
// Copies n elements of `dtype` from src to dst and writes the partial of
// every tile of dst[0, n) to partials[k], as TileSquares(dst) would, each
// tile summed while the copy left it in cache: one pass over the memory
// where a copy and then TileSquares take two. src and dst must not overlap.
Status CopyTileSquares(DType dtype, const void* src, void* dst, size_t n, double* partials);

}  // namespace strata::kernels
