// CUDA Adam/AdamW: one thread per element (grid-stride), the scalar
// reference's operations in the same order with explicit round-to-nearest
// intrinsics (never contracted by -fmad), so results are bitwise equal.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cpu/step_scalars.h"
#include "kernels/cuda/adam_cuda.h"
#include "kernels/cuda/device_elements.cuh"

namespace strata::kernels {
namespace {

using cuda_detail::FirstMoment;
using cuda_detail::LoadAsF32;
using cuda_detail::StoreFromF32;

constexpr int kThreads = 256;

template <DType G, int kCopy, bool kL2, bool kLerp>  // kCopy: 0 none, 1 bf16, 2 f16
__global__ void AdamKernel(AdamStepScalars s, size_t n, float* __restrict__ param,
                           float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                           const void* __restrict__ grad, void* __restrict__ param_copy) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = __fmul_rn(LoadAsF32<G>(grad, i), s.grad_scale);
    float p = param[i];
    if constexpr (kL2) g = __fmaf_rn(p, s.l2, g);
    p = __fmul_rn(p, s.decay);
    const float m = FirstMoment<kLerp>(s, exp_avg[i], g);
    const float v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.sqrt_bc2), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kCopy == 1) StoreFromF32<DType::kBF16>(param_copy, i, p);
    if constexpr (kCopy == 2) StoreFromF32<DType::kF16>(param_copy, i, p);
  }
}

using AdamKernelFn = void (*)(AdamStepScalars, size_t, float*, float*, float*, const void*, void*);

template <DType G, int kCopy>
AdamKernelFn PickL2(bool l2, bool lerp) {
  if (l2) return lerp ? &AdamKernel<G, kCopy, true, true> : &AdamKernel<G, kCopy, true, false>;
  return lerp ? &AdamKernel<G, kCopy, false, true> : &AdamKernel<G, kCopy, false, false>;
}

template <DType G>
AdamKernelFn PickCopy(int copy, bool l2, bool lerp) {
  if (copy == 1) return PickL2<G, 1>(l2, lerp);
  if (copy == 2) return PickL2<G, 2>(l2, lerp);
  return PickL2<G, 0>(l2, lerp);
}

AdamKernelFn PickAdam(DType grad, int copy, bool l2, bool lerp) {
  if (grad == DType::kBF16) return PickCopy<DType::kBF16>(copy, l2, lerp);
  if (grad == DType::kF16) return PickCopy<DType::kF16>(copy, l2, lerp);
  return PickCopy<DType::kF32>(copy, l2, lerp);
}

Status CudaError(const char* op, cudaError_t e) {
  return UnsupportedError(std::string(op) + ": " + cudaGetErrorString(e));
}

}  // namespace

unsigned CudaGridFor(size_t n, int threads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);  // grid-stride beyond
}

Result<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return CudaError("cudaGetDeviceCount", e);
  return count;
}

Status AdamStepCuda(const AdamOptions& opt, size_t n, float* param, float* exp_avg,
                    float* exp_avg_sq, const void* grad, void* param_copy, void* stream) {
  STRATA_RETURN_IF_ERROR(ValidateAdamOptions(opt));
  if (n == 0) return Status::Ok();
  if (!param || !exp_avg || !exp_avg_sq || !grad) return InvalidError("AdamStepCuda: null array");
  const AdamStepScalars s = MakeAdamStepScalars(opt);
  const int copy = param_copy == nullptr ? 0 : (opt.param_copy_dtype == DType::kF16 ? 2 : 1);
  const bool l2 = opt.mode == AdamMode::kAdam && opt.weight_decay != 0;
  const bool lerp = opt.moment_update == MomentUpdate::kLerp;
  cuda_detail::ClearLastErrorBeforeLaunch();
  PickAdam(opt.grad_dtype, copy, l2, lerp)<<<CudaGridFor(n, kThreads), kThreads, 0,
                                       static_cast<cudaStream_t>(stream)>>>(
      s, n, param, exp_avg, exp_avg_sq, grad, param_copy);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return InternalError(std::string("AdamStepCuda launch: ") + cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace strata::kernels
