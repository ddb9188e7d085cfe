// AVX-512 path of the sum of squares: two 8-lane fp64 accumulators hold the 16
// interleaved lanes of the reference, joined by the same tree, so results are
// bitwise equal to norm_scalar.cpp.
#include "kernels/cpu/range_kernels.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/tail_buffers.h"
#include "kernels/cpu/variant_select.h"

namespace strata::kernels::internal {
namespace {

inline __m512d AddSquares(__m512d acc, __m256 x) {
  const __m512d d = _mm512_cvtps_pd(x);
  return _mm512_add_pd(acc, _mm512_mul_pd(d, d));
}

template <DType D>
inline void Accumulate16(__m512d acc[2], const void* x, size_t i) {
  const __m512 a = LoadAsF32x16<D>(x, i);
  acc[0] = AddSquares(acc[0], _mm512_castps512_ps256(a));
  acc[1] = AddSquares(acc[1],
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

template <DType D>
double SumSquaresAvx512(const void* x, size_t begin, size_t end) {
  __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  size_t i = begin;
  for (; i + 16 <= end; i += 16) Accumulate16<D>(acc, x, i);
  if (i < end) {  // zero padding adds +0.0, which leaves every lane unchanged
    TailBuffers<16> t;
    TailBuffers<16>::Take(t.in, x, i, end - i, DTypeSize(D));
    Accumulate16<D>(acc, t.in, 0);
  }
  const __m512d s8 = _mm512_add_pd(acc[0], acc[1]);  // lanes j += j+8
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(s) + _mm_cvtsd_f64(_mm_unpackhi_pd(s, s));
}

}  // namespace

SumSquaresRangeFn SelectSumSquaresAvx512(DType dtype) {
  return WithDType(dtype, [](auto d) -> SumSquaresRangeFn { return &SumSquaresAvx512<decltype(d)::value>; });
}

}  // namespace strata::kernels::internal
