// CUDA Lion and Adagrad: one thread per element (grid-stride), each scalar
// reference's operations in the same order with explicit round-to-nearest
// intrinsics (never contracted by -fmad), so results are bitwise equal. The
// per-step scalars come from kernels/cpu/step_scalars.h, as on the CPU.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cpu/step_scalars.h"
#include "kernels/cuda/device_elements.cuh"
#include "kernels/cuda/optimizers_cuda.h"

namespace strata::kernels {

unsigned CudaGridFor(size_t n, int threads);  // adam.cu

namespace {

using cuda_detail::LoadAsF32;
using cuda_detail::StoreFromF32;

constexpr int kThreads = 256;

// kCopy: 0 none, 1 bf16, 2 f16 (as adam.cu).
template <int kCopy>
__device__ __forceinline__ void StoreCopy(void* param_copy, size_t i, float p) {
  if constexpr (kCopy == 1) StoreFromF32<DType::kBF16>(param_copy, i, p);
  if constexpr (kCopy == 2) StoreFromF32<DType::kF16>(param_copy, i, p);
}

// lion_scalar.cpp's LionSign: +1, -1, 0 for ±0, and c itself for NaN.
__device__ __forceinline__ float LionSign(float c) {
  if (c > 0) return 1.0f;
  if (c < 0) return -1.0f;
  return c == 0 ? 0.0f : c;
}

template <DType G, int kCopy>
__global__ void LionKernel(LionStepScalars s, size_t n, float* __restrict__ param,
                           float* __restrict__ exp_avg, const void* __restrict__ grad,
                           void* __restrict__ param_copy) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = __fmul_rn(LoadAsF32<G>(grad, i), s.grad_scale);
    const float m = exp_avg[i];
    float p = __fmul_rn(param[i], s.decay);
    const float c = __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(m, s.beta1));
    p = __fmaf_rn(s.neg_lr, LionSign(c), p);
    param[i] = p;
    exp_avg[i] = __fmaf_rn(s.one_minus_beta2, g, __fmul_rn(m, s.beta2));
    StoreCopy<kCopy>(param_copy, i, p);
  }
}

template <DType G, int kCopy, bool kL2>
__global__ void AdagradKernel(AdagradStepScalars s, size_t n, float* __restrict__ param,
                              float* __restrict__ state_sum, const void* __restrict__ grad,
                              void* __restrict__ param_copy) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = __fmul_rn(LoadAsF32<G>(grad, i), s.grad_scale);
    float p = param[i];
    if constexpr (kL2) g = __fmaf_rn(p, s.weight_decay, g);
    const float sum = __fmaf_rn(g, g, state_sum[i]);
    p = __fmaf_rn(s.neg_clr, __fdiv_rn(g, __fadd_rn(__fsqrt_rn(sum), s.eps)), p);
    param[i] = p;
    state_sum[i] = sum;
    StoreCopy<kCopy>(param_copy, i, p);
  }
}

using LionKernelFn = void (*)(LionStepScalars, size_t, float*, float*, const void*, void*);
using AdagradKernelFn = void (*)(AdagradStepScalars, size_t, float*, float*, const void*, void*);

template <DType G>
LionKernelFn PickLionCopy(int copy) {
  if (copy == 1) return &LionKernel<G, 1>;
  if (copy == 2) return &LionKernel<G, 2>;
  return &LionKernel<G, 0>;
}

LionKernelFn PickLion(DType grad, int copy) {
  if (grad == DType::kBF16) return PickLionCopy<DType::kBF16>(copy);
  if (grad == DType::kF16) return PickLionCopy<DType::kF16>(copy);
  return PickLionCopy<DType::kF32>(copy);
}

template <DType G, int kCopy>
AdagradKernelFn PickAdagradL2(bool l2) {
  return l2 ? &AdagradKernel<G, kCopy, true> : &AdagradKernel<G, kCopy, false>;
}

template <DType G>
AdagradKernelFn PickAdagradCopy(int copy, bool l2) {
  if (copy == 1) return PickAdagradL2<G, 1>(l2);
  if (copy == 2) return PickAdagradL2<G, 2>(l2);
  return PickAdagradL2<G, 0>(l2);
}

AdagradKernelFn PickAdagrad(DType grad, int copy, bool l2) {
  if (grad == DType::kBF16) return PickAdagradCopy<DType::kBF16>(copy, l2);
  if (grad == DType::kF16) return PickAdagradCopy<DType::kF16>(copy, l2);
  return PickAdagradCopy<DType::kF32>(copy, l2);
}

int CopyKind(const void* param_copy, DType copy_dtype) {
  return param_copy == nullptr ? 0 : (copy_dtype == DType::kF16 ? 2 : 1);
}

Status LaunchResult(const char* who) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string(who) + " launch: " + cudaGetErrorString(e));
}

}  // namespace

Status LionStepCuda(const LionOptions& opt, size_t n, float* param, float* exp_avg, const void* grad,
                    void* param_copy, void* stream) {
  STRATA_RETURN_IF_ERROR(ValidateLionOptions(opt));
  if (n == 0) return Status::Ok();
  if (!param || !exp_avg || !grad) return InvalidError("LionStepCuda: null array");
  const LionStepScalars s = MakeLionStepScalars(opt);
  const LionKernelFn kernel = PickLion(opt.grad_dtype, CopyKind(param_copy, opt.param_copy_dtype));
  const auto cs = static_cast<cudaStream_t>(stream);
  cuda_detail::ClearLastErrorBeforeLaunch();
  kernel<<<CudaGridFor(n, kThreads), kThreads, 0, cs>>>(s, n, param, exp_avg, grad, param_copy);
  return LaunchResult("LionStepCuda");
}

Status AdagradStepCuda(const AdagradOptions& opt, size_t n, float* param, float* state_sum, const void* grad,
                       void* param_copy, void* stream) {
  STRATA_RETURN_IF_ERROR(ValidateAdagradOptions(opt));
  if (n == 0) return Status::Ok();
  if (!param || !state_sum || !grad) return InvalidError("AdagradStepCuda: null array");
  const AdagradStepScalars s = MakeAdagradStepScalars(opt);
  const bool l2 = opt.weight_decay != 0;  // as AdagradStepOn
  const AdagradKernelFn kernel = PickAdagrad(opt.grad_dtype, CopyKind(param_copy, opt.param_copy_dtype), l2);
  const auto cs = static_cast<cudaStream_t>(stream);
  cuda_detail::ClearLastErrorBeforeLaunch();
  kernel<<<CudaGridFor(n, kThreads), kThreads, 0, cs>>>(s, n, param, state_sum, grad, param_copy);
  return LaunchResult("AdagradStepCuda");
}

}  // namespace strata::kernels
