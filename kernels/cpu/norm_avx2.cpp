// AVX2 path of the sum of squares: four 4-lane fp64 accumulators hold the 16
// interleaved lanes of the reference (elements i..i+3 in the first, ...), joined
// by the same tree, so results are bitwise equal to norm_scalar.cpp.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

inline __m256d AddSquares(__m256d acc, __m128 x) {
  const __m256d d = _mm256_cvtps_pd(x);
  return _mm256_add_pd(acc, _mm256_mul_pd(d, d));
}

template <DType D>
inline void Accumulate16(__m256d acc[4], const void* x, size_t i) {
  const __m256 a = LoadAsF32x8<D>(x, i), b = LoadAsF32x8<D>(x, i + 8);
  acc[0] = AddSquares(acc[0], _mm256_castps256_ps128(a));
  acc[1] = AddSquares(acc[1], _mm256_extractf128_ps(a, 1));
  acc[2] = AddSquares(acc[2], _mm256_castps256_ps128(b));
  acc[3] = AddSquares(acc[3], _mm256_extractf128_ps(b, 1));
}

template <DType D>
double SumSquaresAvx2(const void* x, size_t begin, size_t end) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  size_t i = begin;
  for (; i + 16 <= end; i += 16) Accumulate16<D>(acc, x, i);
  if (i < end) {  // zero padding adds +0.0, which leaves every lane unchanged
    TailBuffers<16> t;
    TailBuffers<16>::Take(t.in, x, i, end - i, DTypeSize(D));
    Accumulate16<D>(acc, t.in, 0);
  }
  acc[0] = _mm256_add_pd(acc[0], acc[2]);  // lanes j += j+8
  acc[1] = _mm256_add_pd(acc[1], acc[3]);
  acc[0] = _mm256_add_pd(acc[0], acc[1]);  // lanes j += j+4
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(acc[0]), _mm256_extractf128_pd(acc[0], 1));
  return _mm_cvtsd_f64(s) + _mm_cvtsd_f64(_mm_unpackhi_pd(s, s));
}

}  // namespace

SumSquaresRangeFn SelectSumSquaresAvx2(DType dtype) {
  return WithDType(dtype, [](auto d) -> SumSquaresRangeFn { return &SumSquaresAvx2<decltype(d)::value>; });
}

}  // namespace strata::kernels::internal
