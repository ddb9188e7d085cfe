// Cross-entropy: one warp per row (max, sum of exponentials, then the gradient).
#include <cmath>

#include "kernels/cuda/layers/cross_entropy.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::kThreads;
using cuda_detail::kWarpsPerBlock;
using cuda_detail::Lane;
using cuda_detail::WarpMax;
using cuda_detail::WarpRow;
using cuda_detail::WarpRowStride;
using cuda_detail::WarpSum;

// In place (dlogits == logits) is safe: each lane writes only its own columns
// (which it reads just before), and the __syncwarp orders every lane's read of
// z[target] before any lane's writes.
__global__ void CrossEntropyKernel(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                   size_t N, size_t V, float dloss) {
  for (size_t r = WarpRow(); r < N; r += WarpRowStride()) {
    const float* z = logits + r * V;
    const int32_t target = targets[r];
    const bool in_range = target >= 0 && static_cast<size_t>(target) < V;
    const float z_target = in_range ? z[target] : nanf("");
    float maxv = -INFINITY;
    for (size_t i = Lane(); i < V; i += 32) maxv = fmaxf(maxv, z[i]);
    maxv = WarpMax(maxv);
    float sum = 0.0f;
    for (size_t i = Lane(); i < V; i += 32) sum += expf(z[i] - maxv);
    sum = WarpSum(sum);
    if (Lane() == 0) losses[r] = logf(sum) + maxv - z_target;
    if (dlogits == nullptr) continue;
    const float inv = 1.0f / sum;
    __syncwarp();  // z[target] is read by all lanes before the lane that owns it overwrites it
    float* dz = dlogits + r * V;
    for (size_t i = Lane(); i < V; i += 32) {
      const float p = expf(z[i] - maxv) * inv * dloss;
      dz[i] = !in_range ? nanf("") : (i == static_cast<size_t>(target) ? p - dloss : p);
    }
  }
}

}  // namespace

Status CrossEntropyForwardBackwardCuda(const CudaLayerContext& ctx, float* losses, float* dlogits,
                                       const float* logits, const int32_t* targets, size_t N, size_t V,
                                       float dloss) {
  if (N == 0) return Status::Ok();
  CrossEntropyKernel<<<BlocksFor(N, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(losses, dlogits, logits,
                                                                                targets, N, V, dloss);
  STRATA_LAUNCH_OK("CrossEntropyKernel");
  return Status::Ok();
}

}  // namespace strata::layers
