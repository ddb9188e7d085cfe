// LayerNorm forward and backward: rows in parallel for the per-row work,
// channel tiles in parallel for the weight and bias gradients (rows in order).
#include "kernels/cpu/layers/layernorm.h"

#include <cmath>

#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {

using detail::ForEachTile;
using detail::kChannelTile;
using detail::kRowTile;

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, size_t N, size_t C) {
  ForEachTile(N, kRowTile, [&](size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; ++r) {
      const float* x = inp + r * C;
      double sum = 0;
      for (size_t i = 0; i < C; ++i) sum += x[i];
      const double m = sum / static_cast<double>(C);
      double var = 0;
      for (size_t i = 0; i < C; ++i) var += (x[i] - m) * (x[i] - m);
      var /= static_cast<double>(C);
      const float mf = static_cast<float>(m);
      const float s = static_cast<float>(1.0 / std::sqrt(var + kLayerNormEps));
      float* y = out + r * C;
      for (size_t i = 0; i < C; ++i) y[i] = (x[i] - mf) * s * weight[i] + bias[i];
      mean[r] = mf;
      rstd[r] = s;
    }
  });
}

void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, const float* mean, const float* rstd, size_t N, size_t C) {
  // dinp = rstd · (dnorm - mean(dnorm) - norm · mean(dnorm · norm)), dnorm = weight · dout
  ForEachTile(N, kRowTile, [&](size_t r0, size_t r1) {
    for (size_t r = r0; r < r1; ++r) {
      const float* x = inp + r * C;
      const float* dy = dout + r * C;
      const float m = mean[r], s = rstd[r];
      double dnorm_sum = 0, dnorm_norm_sum = 0;
      for (size_t i = 0; i < C; ++i) {
        const float dnorm = weight[i] * dy[i];
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * ((x[i] - m) * s);
      }
      const float dnorm_mean = static_cast<float>(dnorm_sum / static_cast<double>(C));
      const float dnorm_norm_mean = static_cast<float>(dnorm_norm_sum / static_cast<double>(C));
      float* dx = dinp + r * C;
      for (size_t i = 0; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        dx[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
  });
  ForEachTile(C, kChannelTile, [&](size_t c0, size_t c1) {
    for (size_t r = 0; r < N; ++r) {
      const float* x = inp + r * C;
      const float* dy = dout + r * C;
      const float m = mean[r], s = rstd[r];
      for (size_t i = c0; i < c1; ++i) {
        dweight[i] += (x[i] - m) * s * dy[i];
        dbias[i] += dy[i];
      }
    }
  });
}

}  // namespace strata::layers
