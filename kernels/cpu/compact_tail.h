// Internal: the last, partial block of a compact range for a SIMD path's
// block body: zero-padded stack copies of the r (< kCompactBlock) elements
// run the whole-block code (padding reads as 0 and cannot raise a block
// maximum), then the r elements, the block's scales and the copy-out go back.
// Arrays that are null (v of Lion) are left null.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/compact_kernels.h"

namespace strata::kernels::internal {
namespace {

template <typename Block>
inline void RunCompactTail(const CompactArrays& a, size_t i, size_t r, size_t grad_bytes, size_t copy_bytes,
                           Block block) {
  alignas(64) uint16_t hi[kCompactBlock] = {};
  alignas(64) int8_t lo[kCompactBlock] = {}, mq[kCompactBlock] = {};
  alignas(64) uint8_t vq[kCompactBlock] = {};
  alignas(64) uint8_t grad[4 * kCompactBlock] = {}, copy[4 * kCompactBlock] = {};
  const size_t b = i / kCompactBlock;
  const bool has_v = a.s.v_code != nullptr;
  float ms = a.s.m_scale[b], vs = has_v ? a.s.v_scale[b] : 0.0f;
  std::memcpy(hi, a.s.w_hi + i, 2 * r);
  std::memcpy(lo, a.s.w_lo + i, r);
  std::memcpy(mq, a.s.m_code + i, r);
  if (has_v) std::memcpy(vq, a.s.v_code + i, r);
  std::memcpy(grad, static_cast<const uint8_t*>(a.grad) + i * grad_bytes, r * grad_bytes);
  const CompactArrays x{{hi, lo, mq, &ms, has_v ? vq : nullptr, has_v ? &vs : nullptr}, grad, copy};
  block(x);
  std::memcpy(a.s.w_hi + i, hi, 2 * r);
  std::memcpy(a.s.w_lo + i, lo, r);
  std::memcpy(a.s.m_code + i, mq, r);
  a.s.m_scale[b] = ms;
  if (has_v) {
    std::memcpy(a.s.v_code + i, vq, r);
    a.s.v_scale[b] = vs;
  }
  if (copy_bytes) std::memcpy(static_cast<uint8_t*>(a.param_copy) + i * copy_bytes, copy, r * copy_bytes);
}

inline constexpr size_t CompactCopyBytes(CompactCopy c) {
  return c == CompactCopy::kF32 ? 4 : c == CompactCopy::kNone ? 0 : 2;
}

}  // namespace
}  // namespace strata::kernels::internal
