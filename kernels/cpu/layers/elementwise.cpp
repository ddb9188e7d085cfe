// GELU and residual add over fixed element tiles.
#include "kernels/cpu/layers/elementwise.h"

#include <cmath>

#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {
namespace {

using detail::ForEachTile;
using detail::kElementTile;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/π)
constexpr float kGeluCube = 0.044715f;

}  // namespace

void GeluForward(float* out, const float* inp, size_t n) {
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) {
      const float x = inp[i];
      out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + kGeluCube * x * x * x)));
    }
  });
}

void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) {
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) {
      const float x = inp[i];
      const float th = std::tanh(kGeluScale * (x + kGeluCube * x * x * x));
      const float dth = (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCube * x * x);
      dinp[i] += (0.5f * (1.0f + th) + 0.5f * x * dth) * dout[i];
    }
  });
}

void ResidualForward(float* out, const float* a, const float* b, size_t n) {
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

void ResidualBackward(float* da, float* db, const float* dout, size_t n) {
  ForEachTile(n, kElementTile, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i) {
      if (da != nullptr) da[i] += dout[i];
      if (db != nullptr) db[i] += dout[i];
    }
  });
}

}  // namespace strata::layers
