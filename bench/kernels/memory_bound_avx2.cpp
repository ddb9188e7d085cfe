// AVX2 loops of the memory bound, 8 lanes like the AVX2 kernels: p += g,
// m += g, v += g, and the copy-out keeps p's top 16 bits. They prefetch as
// the kernels do (kernels/cpu/prefetch.h: each stream kPrefetchAhead elements
// ahead), so the peer moves its bytes on the kernels' terms.
#include <immintrin.h>

#include <initializer_list>

#include "bench/kernels/memory_bound.h"
#include "kernels/cpu/prefetch.h"

namespace strata::bench {
namespace {

template <bool kBf16Grad>
inline __m256 LoadGrad(const void* g, size_t i) {
  if constexpr (kBf16Grad) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  }
}

template <bool kBf16Grad, bool kCopy>
void BoundAvx2(const BoundArrays& a, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    kernels::internal::PrefetchStreams(i + kernels::internal::kPrefetchAhead, a.grad, kBf16Grad ? 2 : 4,
                                       a.param, a.exp_avg, a.exp_avg_sq);
    const __m256 g = LoadGrad<kBf16Grad>(a.grad, i);
    const __m256 p = _mm256_add_ps(_mm256_loadu_ps(a.param + i), g);
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.exp_avg + i, _mm256_add_ps(_mm256_loadu_ps(a.exp_avg + i), g));
    _mm256_storeu_ps(a.exp_avg_sq + i, _mm256_add_ps(_mm256_loadu_ps(a.exp_avg_sq + i), g));
    if constexpr (kCopy) {
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(p), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.param_copy + i),
                       _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    }
  }
  for (; i < end; ++i) {  // the benchmark's sizes are multiples of 8; kept for safety
    const float g = kBf16Grad ? 0.0f : static_cast<const float*>(a.grad)[i];
    a.param[i] += g;
    a.exp_avg[i] += g;
    a.exp_avg_sq[i] += g;
  }
}

// 32 elements an iteration: hi += g, and the byte streams += g's low bytes.
void CompactBoundAvx2(const CompactBoundArrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += 32) {
    // As CompactAdamAvx2::Run: one line of each stream a block, ahead.
    kernels::internal::PrefetchStreams(i + kernels::internal::kPrefetchAhead, a.grad, 2, a.s.w_hi, a.s.w_lo,
                                       a.s.m_code, a.s.v_code);
    const __m256i g0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.grad + i));
    const __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.grad + i + 16));
    auto* h = reinterpret_cast<__m256i*>(a.s.w_hi + i);
    _mm256_storeu_si256(h, _mm256_add_epi16(_mm256_loadu_si256(h), g0));
    _mm256_storeu_si256(h + 1, _mm256_add_epi16(_mm256_loadu_si256(h + 1), g1));
    const __m256i b = _mm256_packus_epi16(_mm256_and_si256(g0, _mm256_set1_epi16(0xff)),
                                          _mm256_and_si256(g1, _mm256_set1_epi16(0xff)));
    for (void* x : {static_cast<void*>(a.s.w_lo + i), static_cast<void*>(a.s.m_code + i),
                    static_cast<void*>(a.s.v_code + i)}) {
      auto* p = static_cast<__m256i*>(x);
      _mm256_storeu_si256(p, _mm256_add_epi8(_mm256_loadu_si256(p), b));
    }
    a.s.m_scale[i / 32] += 1.0f;
    a.s.v_scale[i / 32] += 1.0f;
  }
}

}  // namespace

CompactBoundRangeFn SelectCompactBoundAvx2() { return &CompactBoundAvx2; }

BoundRangeFn SelectBoundAvx2(bool bf16_grad, bool copy) {
  if (bf16_grad) return copy ? &BoundAvx2<true, true> : &BoundAvx2<true, false>;
  return copy ? &BoundAvx2<false, true> : &BoundAvx2<false, false>;
}

}  // namespace strata::bench
