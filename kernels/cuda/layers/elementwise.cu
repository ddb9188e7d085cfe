// GELU and the residual add, one thread per element (grid-stride).
#include "kernels/cuda/layers/elementwise.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::GlobalThread;
using cuda_detail::GridThreads;
using cuda_detail::kThreads;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/π)
constexpr float kGeluCube = 0.044715f;

__global__ void GeluForwardKernel(float* out, const float* inp, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + kGeluCube * x * x * x)));
  }
}

__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float x = inp[i];
    const float th = tanhf(kGeluScale * (x + kGeluCube * x * x * x));
    const float dth = (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCube * x * x);
    dinp[i] += (0.5f * (1.0f + th) + 0.5f * x * dth) * dout[i];
  }
}

__global__ void ResidualForwardKernel(float* out, const float* a, const float* b, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = a[i] + b[i];
}

}  // namespace

Status GeluForwardCuda(const CudaLayerContext& ctx, float* out, const float* inp, size_t n) {
  if (n == 0) return Status::Ok();
  GeluForwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, ctx.stream>>>(out, inp, n);
  STRATA_LAUNCH_OK("GeluForwardKernel");
  return Status::Ok();
}

Status GeluBackwardCuda(const CudaLayerContext& ctx, float* dinp, const float* inp, const float* dout,
                        size_t n) {
  if (n == 0) return Status::Ok();
  GeluBackwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, ctx.stream>>>(dinp, inp, dout, n);
  STRATA_LAUNCH_OK("GeluBackwardKernel");
  return Status::Ok();
}

Status ResidualForwardCuda(const CudaLayerContext& ctx, float* out, const float* a, const float* b,
                           size_t n) {
  if (n == 0) return Status::Ok();
  ResidualForwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, ctx.stream>>>(out, a, b, n);
  STRATA_LAUNCH_OK("ResidualForwardKernel");
  return Status::Ok();
}

}  // namespace strata::layers
