// Internal: software prefetch of an optimizer's streams, one 64-byte line of
// each, kPrefetchAhead elements ahead of the update. Four to eight streams
// are more than the hardware prefetchers keep ahead of on their own (about
// 10% of a memory-bound Adam step here).
//
// always_inline, and called from the loop itself: as a function of its own,
// GCC 12 finds a helper that only prefetches free of side effects (ipa
// pure-const) and deletes the call, prefetches and all.
// tests/kernels/prefetch_emitted_test.sh checks the machine code.
#pragma once

#include <xmmintrin.h>

#include <cstddef>

namespace strata::kernels::internal {
namespace {

inline constexpr size_t kPrefetchAhead = 512;  // elements: 2 KiB of each f32 stream

// Element i of the f32 `states` and of `grad` (grad_size bytes an element).
template <typename... States>
[[gnu::always_inline]] inline void PrefetchStreams(size_t i, const void* grad, size_t grad_size,
                                                   const States*... states) {
  (_mm_prefetch(reinterpret_cast<const char*>(states + i), _MM_HINT_T0), ...);
  _mm_prefetch(static_cast<const char*>(grad) + i * grad_size, _MM_HINT_T0);
}

}  // namespace
}  // namespace strata::kernels::internal
