// LayerNorm: one warp per row for the per-row work; the weight and bias
// gradients sum over rows in column_grads (fixed order, no atomics).
#include "kernels/cpu/layers/layernorm.h"
#include "kernels/cuda/layers/column_grads.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/layernorm.h"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::kThreads;
using cuda_detail::kWarpsPerBlock;
using cuda_detail::Lane;
using cuda_detail::WarpRow;
using cuda_detail::WarpRowStride;
using cuda_detail::WarpSum;

__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                                       const float* weight, const float* bias, size_t N, size_t C) {
  for (size_t r = WarpRow(); r < N; r += WarpRowStride()) {
    const float* x = inp + r * C;
    float sum = 0.0f;
    for (size_t i = Lane(); i < C; i += 32) sum += x[i];
    const float m = WarpSum(sum) / static_cast<float>(C);
    float var = 0.0f;
    for (size_t i = Lane(); i < C; i += 32) {
      const float d = x[i] - m;
      var += d * d;
    }
    const float s = 1.0f / sqrtf(WarpSum(var) / static_cast<float>(C) + kLayerNormEps);
    float* y = out + r * C;
    for (size_t i = Lane(); i < C; i += 32) y[i] = (x[i] - m) * s * weight[i] + bias[i];
    if (Lane() == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
  }
}

// dinp = rstd · (dnorm - mean(dnorm) - norm · mean(dnorm · norm)), dnorm = weight · dout.
__global__ void LayerNormBackwardRowsKernel(float* dinp, const float* dout, const float* inp,
                                            const float* weight, const float* mean, const float* rstd,
                                            size_t N, size_t C) {
  for (size_t r = WarpRow(); r < N; r += WarpRowStride()) {
    const float* x = inp + r * C;
    const float* dy = dout + r * C;
    const float m = mean[r], s = rstd[r];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (size_t i = Lane(); i < C; i += 32) {
      const float dnorm = weight[i] * dy[i];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * ((x[i] - m) * s);
    }
    const float dnorm_mean = WarpSum(dnorm_sum) / static_cast<float>(C);
    const float dnorm_norm_mean = WarpSum(dnorm_norm_sum) / static_cast<float>(C);
    float* dx = dinp + r * C;
    for (size_t i = Lane(); i < C; i += 32) {
      const float norm = (x[i] - m) * s;
      dx[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

}  // namespace

Status LayerNormForwardCuda(const CudaLayerContext& ctx, float* out, float* mean, float* rstd,
                            const float* inp, const float* weight, const float* bias, size_t N, size_t C) {
  if (N == 0 || C == 0) return Status::Ok();
  LayerNormForwardKernel<<<BlocksFor(N, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(out, mean, rstd, inp,
                                                                                    weight, bias, N, C);
  STRATA_LAUNCH_OK("LayerNormForwardKernel");
  return Status::Ok();
}

size_t LayerNormBackwardScratchBytes(size_t C) { return cuda_detail::ColumnGradScratchBytes(C); }

Status LayerNormBackwardCuda(const CudaLayerContext& ctx, float* dinp, float* dweight, float* dbias,
                             const float* dout, const float* inp, const float* weight, const float* mean,
                             const float* rstd, size_t N, size_t C, CudaScratch scratch) {
  if (N == 0 || C == 0) return Status::Ok();
  LayerNormBackwardRowsKernel<<<BlocksFor(N, kWarpsPerBlock), kThreads, 0, ctx.stream>>>(
      dinp, dout, inp, weight, mean, rstd, N, C);
  STRATA_LAUNCH_OK("LayerNormBackwardRowsKernel");
  return cuda_detail::ColumnGrads(ctx, dweight, dbias, dout, inp, mean, rstd, N, C, scratch);
}

}  // namespace strata::layers
