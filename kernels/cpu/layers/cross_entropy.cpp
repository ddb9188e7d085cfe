// Softmax cross-entropy: rows in parallel; each row's max, sum and gradient in order.
#include "kernels/cpu/layers/cross_entropy.h"

#include <cmath>

#include "base/check.h"
#include "kernels/cpu/layers/tiles.h"

namespace strata::layers {

using detail::ForEachIndex;

void CrossEntropyForwardBackward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                 size_t N, size_t V, float dloss) {
  ForEachIndex(N, 4, [&](size_t r) {
    const float* z = logits + r * V;
    const int32_t target = targets[r];
    STRATA_CHECK_MSG(target >= 0 && static_cast<size_t>(target) < V, "target id out of the vocabulary");
    float maxv = -INFINITY;
    for (size_t i = 0; i < V; ++i) maxv = z[i] > maxv ? z[i] : maxv;
    double sum = 0;
    for (size_t i = 0; i < V; ++i) sum += std::exp(z[i] - maxv);
    const float z_target = z[target];
    losses[r] = static_cast<float>(std::log(sum) + static_cast<double>(maxv) - z_target);
    if (dlogits == nullptr) return;
    const float inv = static_cast<float>(1.0 / sum);
    float* dz = dlogits + r * V;
    for (size_t i = 0; i < V; ++i) dz[i] = std::exp(z[i] - maxv) * inv * dloss;
    dz[target] -= dloss;
  });
}

}  // namespace strata::layers
