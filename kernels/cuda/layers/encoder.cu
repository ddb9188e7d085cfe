// Embedding lookup, and its scatter-add backward as gathers: each output
// element of dwte and dwpe is one thread that walks the rows feeding it in order.
#include <cmath>

#include "kernels/cuda/layers/encoder.h"
#include "kernels/cuda/layers/launch.cuh"
#include "kernels/cuda/layers/status_cuda.h"

namespace strata::layers {
namespace {

using cuda_detail::BlocksFor;
using cuda_detail::GlobalThread;
using cuda_detail::GridThreads;
using cuda_detail::kThreads;

// One thread per element (r, c) of out, r = b·T + t.
__global__ void EncoderForwardKernel(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                                     size_t N, size_t T, size_t C, size_t V) {
  for (size_t i = GlobalThread(); i < N * C; i += GridThreads()) {
    const size_t r = i / C, c = i % C;
    const int32_t tok = tokens[r];
    if (tok < 0 || static_cast<size_t>(tok) >= V) {
      out[i] = nanf("");
      continue;
    }
    out[i] = wte[static_cast<size_t>(tok) * C + c] + wpe[(r % T) * C + c];
  }
}

// One thread per element (v, c) of dwte: Σ over rows r with tokens[r] == v, r in order.
// Neighbouring threads share v, so a warp reads each token id once.
__global__ void EncoderBackwardWteKernel(float* dwte, const float* dout, const int32_t* tokens, size_t N,
                                         size_t C, size_t V) {
  for (size_t i = GlobalThread(); i < V * C; i += GridThreads()) {
    const size_t v = i / C, c = i % C;
    float sum = 0.0f;
    for (size_t r = 0; r < N; ++r)
      if (static_cast<size_t>(tokens[r]) == v) sum += dout[r * C + c];
    dwte[i] += sum;
  }
}

// One thread per element (t, c) of dwpe: Σ_b dout[b, t, c], b in order.
__global__ void EncoderBackwardWpeKernel(float* dwpe, const float* dout, size_t B, size_t T, size_t C) {
  for (size_t i = GlobalThread(); i < T * C; i += GridThreads()) {
    float sum = 0.0f;
    for (size_t b = 0; b < B; ++b) sum += dout[b * T * C + i];
    dwpe[i] += sum;
  }
}

}  // namespace

Status EncoderForwardCuda(const CudaLayerContext& ctx, float* out, const int32_t* tokens, const float* wte,
                          const float* wpe, size_t B, size_t T, size_t C, size_t V) {
  const size_t N = B * T;
  if (N == 0 || C == 0) return Status::Ok();
  EncoderForwardKernel<<<BlocksFor(N * C, kThreads), kThreads, 0, ctx.stream>>>(out, tokens, wte, wpe, N, T,
                                                                                C, V);
  STRATA_LAUNCH_OK("EncoderForwardKernel");
  return Status::Ok();
}

Status EncoderBackwardCuda(const CudaLayerContext& ctx, float* dwte, float* dwpe, const float* dout,
                           const int32_t* tokens, size_t B, size_t T, size_t C, size_t V) {
  const size_t N = B * T;
  if (N == 0 || C == 0) return Status::Ok();
  EncoderBackwardWteKernel<<<BlocksFor(V * C, kThreads), kThreads, 0, ctx.stream>>>(dwte, dout, tokens, N, C,
                                                                                    V);
  STRATA_LAUNCH_OK("EncoderBackwardWteKernel");
  EncoderBackwardWpeKernel<<<BlocksFor(T * C, kThreads), kThreads, 0, ctx.stream>>>(dwpe, dout, B, T, C);
  STRATA_LAUNCH_OK("EncoderBackwardWpeKernel");
  return Status::Ok();
}

}  // namespace strata::layers
