// Internal: stack copies of the last (< one vector of) elements of a range, so
// that a SIMD path runs its one vector body on them too, zero-padded, and the
// tail gets exactly the same operations as every other element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::kernels::internal {
namespace {

template <size_t W>
struct TailBuffers {
  alignas(64) float f[3][W] = {};   // up to three f32 state arrays
  alignas(64) uint8_t in[4 * W] = {};   // gradient or cast source, any dtype
  alignas(64) uint8_t out[4 * W] = {};  // copy-out or cast destination

  // Copies r elements of `bytes` each from src + i*bytes into dst, and back.
  static void Take(void* dst, const void* src, size_t i, size_t r, size_t bytes) {
    std::memcpy(dst, static_cast<const uint8_t*>(src) + i * bytes, r * bytes);
  }
  static void Give(void* dst, const void* src, size_t i, size_t r, size_t bytes) {
    std::memcpy(static_cast<uint8_t*>(dst) + i * bytes, src, r * bytes);
  }
};

}  // namespace
}  // namespace strata::kernels::internal
