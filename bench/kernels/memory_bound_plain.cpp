// Plain C++ loops of the memory bound, for CPUs without AVX2.
#include <cstring>

#include "bench/kernels/memory_bound.h"

namespace strata::bench {
namespace {

template <bool kBf16Grad, bool kCopy>
void BoundPlain(const BoundArrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float g;
    if constexpr (kBf16Grad) {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(a.grad)[i]) << 16;
      std::memcpy(&g, &bits, 4);
    } else {
      g = static_cast<const float*>(a.grad)[i];
    }
    const float p = a.param[i] + g;
    a.param[i] = p;
    a.exp_avg[i] += g;
    a.exp_avg_sq[i] += g;
    if constexpr (kCopy) {
      uint32_t bits;
      std::memcpy(&bits, &p, 4);
      a.param_copy[i] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

void CompactBoundPlain(const CompactBoundArrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const uint16_t g = a.grad[i];
    a.s.w_hi[i] = static_cast<uint16_t>(a.s.w_hi[i] + g);
    a.s.w_lo[i] = static_cast<int8_t>(a.s.w_lo[i] + g);
    a.s.m_code[i] = static_cast<int8_t>(a.s.m_code[i] + g);
    a.s.v_code[i] = static_cast<uint8_t>(a.s.v_code[i] + g);
    if (i % 32 == 0) a.s.m_scale[i / 32] += 1.0f, a.s.v_scale[i / 32] += 1.0f;
  }
}

}  // namespace

CompactBoundRangeFn SelectCompactBoundPlain() { return &CompactBoundPlain; }

BoundRangeFn SelectBoundPlain(bool bf16_grad, bool copy) {
  if (bf16_grad) return copy ? &BoundPlain<true, true> : &BoundPlain<true, false>;
  return copy ? &BoundPlain<false, true> : &BoundPlain<false, false>;
}

}  // namespace strata::bench
