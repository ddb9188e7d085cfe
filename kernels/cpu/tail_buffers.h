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

// The tail of a range for an optimizer's vector body: runs block(x) once,
// where x is `a` with its f32 state arrays (`states`, param first), its
// gradient (`grad_bytes` per element) and its copy-out pointed at zero-padded
// stack copies of the r (< W) elements at i; then writes the states, and the
// copy-out when `copy_bytes` is not 0, back.
template <size_t W, typename Arrays, size_t N, typename Block>
inline void RunTail(const Arrays& a, float* Arrays::* const (&states)[N], size_t grad_bytes, size_t copy_bytes,
                    size_t i, size_t r, Block block) {
  static_assert(N <= 3, "TailBuffers holds three state arrays");
  using T = TailBuffers<W>;
  T t;
  Arrays x = a;
  for (size_t j = 0; j < N; ++j) {
    T::Take(t.f[j], a.*states[j], i, r, 4);
    x.*states[j] = t.f[j];
  }
  T::Take(t.in, a.grad, i, r, grad_bytes);
  x.grad = t.in;
  x.param_copy = t.out;
  block(x);
  for (size_t j = 0; j < N; ++j) T::Give(a.*states[j], t.f[j], i, r, 4);
  if (copy_bytes) T::Give(a.param_copy, t.out, i, r, copy_bytes);
}

}  // namespace
}  // namespace strata::kernels::internal
