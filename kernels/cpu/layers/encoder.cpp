// Embedding lookup and its scatter-add backward. The backward runs channel
// tiles in parallel, each walking every (b, t) in order, so repeated tokens
// add up in a fixed order without atomics.
#include "kernels/cpu/layers/encoder.h"

#include "base/check.h"
#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {

using detail::ForEachTile;
using detail::kChannelTile;
using detail::kRowTile;

void EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, size_t B, size_t T,
                    size_t C, size_t V) {
  ForEachTile(B * T, kRowTile, [&](size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; ++r) {
      const int32_t tok = tokens[r];
      STRATA_CHECK_MSG(tok >= 0 && static_cast<size_t>(tok) < V, "token id out of the vocabulary");
      const float* e = wte + static_cast<size_t>(tok) * C;
      const float* p = wpe + (r % T) * C;
      float* y = out + r * C;
      for (size_t i = 0; i < C; ++i) y[i] = e[i] + p[i];
    }
  });
}

void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, size_t B, size_t T,
                     size_t C) {
  ForEachTile(C, kChannelTile, [&](size_t c0, size_t c1) {
    for (size_t r = 0; r < B * T; ++r) {
      const float* dy = dout + r * C;
      float* de = dwte + static_cast<size_t>(tokens[r]) * C;
      float* dp = dwpe + (r % T) * C;
      for (size_t i = c0; i < c1; ++i) {
        de[i] += dy[i];
        dp[i] += dy[i];
      }
    }
  });
}

}  // namespace strata::layers
