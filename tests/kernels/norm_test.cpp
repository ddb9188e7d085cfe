// Sum of squares: every SIMD path bitwise equal to the scalar reference, fp64
// accumulation, independence from the thread count, and the non-finite report.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/norm.h"
#include "kernels/cpu/parallel.h"
#include "tests/kernels/kernel_test_util.h"

namespace strata::kernels::test {
namespace {

std::vector<CpuIsa> AllPathsHere() {
  std::vector<CpuIsa> paths = {CpuIsa::kScalar};
  for (CpuIsa isa : SimdPathsHere()) paths.push_back(isa);
  return paths;
}

SquaresSum Sum(CpuIsa isa, DType dtype, const void* x, size_t n) {
  SquaresSum out;
  const Status st = SumSquaresOn(isa, dtype, x, n, &out);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

TEST(SumSquares, SimdPathsEqualScalarBitwise) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (size_t n : {size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{1023},
                     size_t{1024}, size_t{1025}, size_t{65537}, (size_t{1} << 20) + 3})
      for (size_t off : {0, 1, 9}) {
        Buffer x(n, DTypeSize(dtype), off);
        Rng rng(n + off);
        for (size_t i = 0; i < n; ++i) StoreAs(dtype, x.data(), i, rng.Spread() * 100.0f);
        const SquaresSum ref = Sum(CpuIsa::kScalar, dtype, x.data(), n);
        EXPECT_TRUE(ref.all_finite);
        for (CpuIsa isa : SimdPathsHere()) {
          const SquaresSum got = Sum(isa, dtype, x.data(), n);
          EXPECT_EQ(F32Bits(0), 0u);
          EXPECT_EQ(got.sum_squares, ref.sum_squares)
              << CpuIsaName(isa) << " " << DTypeName(dtype) << " n=" << n << " off=" << off;
          EXPECT_TRUE(got.all_finite);
        }
      }
}

TEST(SumSquares, AccumulatesInFp64) {
  // (1 + 2^-12)^2 needs 25 significant bits: a float accumulator would round
  // every term; fp64 holds the exact sum n * (1 + 2^-11 + 2^-24).
  const size_t n = size_t{1} << 20;
  std::vector<float> x(n, 1.0f + std::ldexp(1.0f, -12));
  const double want = static_cast<double>(n) * (1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -24));
  for (CpuIsa isa : AllPathsHere()) EXPECT_EQ(Sum(isa, DType::kF32, x.data(), n).sum_squares, want);
  // Terms far below the running sum still count: 2^24 + 2^20 * 1.
  std::vector<float> y(n + 1, 1.0f);
  y[0] = 4096.0f;
  for (CpuIsa isa : AllPathsHere())
    EXPECT_EQ(Sum(isa, DType::kF32, y.data(), n + 1).sum_squares, 16777216.0 + n);
}

TEST(SumSquares, SameForAnyThreadCount) {
  const size_t n = (size_t{1} << 21) + 5;
  std::vector<float> x(n);
  Rng rng(3);
  for (float& f : x) f = rng.Spread();
  SetCpuKernelThreads(1);
  const double one = Sum(CpuIsa::kScalar, DType::kF32, x.data(), n).sum_squares;
  SetCpuKernelThreads(0);
  for (CpuIsa isa : AllPathsHere()) EXPECT_EQ(Sum(isa, DType::kF32, x.data(), n).sum_squares, one);
}

TEST(SumSquares, ReportsNonFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (float bad : {std::nanf(""), inf, -inf})
      for (size_t pos : {size_t{0}, size_t{5000}, size_t{70000}, size_t{70002}}) {
        const size_t n = 70003;  // two reduce tiles and a SIMD tail
        Buffer x(n, DTypeSize(dtype), 3);
        for (size_t i = 0; i < n; ++i) StoreAs(dtype, x.data(), i, 0.5f);
        StoreAs(dtype, x.data(), pos, bad);
        for (CpuIsa isa : AllPathsHere())
          EXPECT_FALSE(Sum(isa, dtype, x.data(), n).all_finite)
              << CpuIsaName(isa) << " " << DTypeName(dtype) << " bad=" << bad << " at " << pos;
      }
  // fp16 overflow: 65504 is finite, its square is no problem in fp64.
  const uint16_t max_half = 0x7bff;
  for (CpuIsa isa : AllPathsHere()) EXPECT_TRUE(Sum(isa, DType::kF16, &max_half, 1).all_finite);
}

// A sum gathered a piece at a time (the engine's gradients in parts):
// TileSquares + JoinTiles, and CopyTileSquares's copy and partials, are
// SumSquares bitwise, the last short tile included; the copy is exact.
TEST(SumSquares, TilesJoinedAndCopiedEqualTheWholeSum) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (size_t n : {size_t{5}, kReduceTile, kReduceTile + 1, 3 * kReduceTile + 4097}) {
      Buffer x(n, DTypeSize(dtype), 0);
      Rng rng(n + 11);
      for (size_t i = 0; i < n; ++i) StoreAs(dtype, x.data(), i, rng.Spread() * 50.0f);
      SquaresSum whole;
      ASSERT_TRUE(SumSquares(dtype, x.data(), n, &whole).ok());
      const size_t tiles = (n + kReduceTile - 1) / kReduceTile;
      std::vector<double> partial(tiles, -1.0), copied(tiles, -1.0);
      ASSERT_TRUE(TileSquares(dtype, x.data(), n, partial.data()).ok());
      EXPECT_EQ(JoinTiles(partial.data(), tiles).sum_squares, whole.sum_squares) << DTypeName(dtype) << " n=" << n;
      Buffer y(n, DTypeSize(dtype), 0);
      ASSERT_TRUE(CopyTileSquares(dtype, x.data(), y.data(), n, copied.data()).ok());
      EXPECT_EQ(std::memcmp(x.data(), y.data(), n * DTypeSize(dtype)), 0) << DTypeName(dtype) << " n=" << n;
      for (size_t k = 0; k < tiles; ++k) EXPECT_EQ(copied[k], partial[k]) << "tile " << k << " n=" << n;
      EXPECT_TRUE(JoinTiles(copied.data(), tiles).all_finite);
    }
  const double nan_tile[2] = {1.0, std::nan("")};
  EXPECT_FALSE(JoinTiles(nan_tile, 2).all_finite);
}

}  // namespace
}  // namespace strata::kernels::test

int main(int argc, char** argv) { return strata::kernels::test::RunPathTests(argc, argv); }
