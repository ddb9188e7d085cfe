// The optimizer on the GPU for W, M, V homed on the device: the choice (made
// once, at build), the device scratch it reserves there, and one group's
// update in place — G copied in, the CUDA twin of the CPU kernel, P written
// on the device or copied home. The pipeline around it is pipeline.cpp.
#include "engine/step/gpu_update.h"

#include <algorithm>
#include <cstring>

#include "base/align.h"
#include "base/log.h"
#include "base/sizes.h"
#include "kernels/cpu/step_scalars.h"
#include "tiers/gpu.h"
#if STRATA_HAVE_CUDA
#include "kernels/cuda/compact_cuda.h"
#include "kernels/cuda/optimizers_cuda.h"
#endif

namespace strata {

namespace {

bool IsOptimizerState(int s) {
  return s == int(StateKind::kW) || s == int(StateKind::kM) || s == int(StateKind::kV);
}

}  // namespace

StepKernelOptions MakeStepKernelOptions(const std::string& type, bool adamw, const StepHyper& h, DType grad,
                                        DType copy) {
  StepKernelOptions o;
  o.type = type;
  kernels::AdamOptions& a = o.adam;
  a.lr = h.lr;
  a.beta1 = h.beta1;
  a.beta2 = h.beta2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  a.step = h.step;
  a.mode = adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  a.grad_scale = h.grad_scale;
  a.grad_dtype = grad;
  a.param_copy_dtype = copy;
  o.lion = kernels::LionOptions{h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale, grad, copy};
  kernels::AdagradOptions& d = o.adagrad;
  d.lr = h.lr;
  d.weight_decay = h.weight_decay;
  d.eps = h.eps;
  d.step = h.step;
  d.grad_scale = h.grad_scale;
  d.grad_dtype = grad;
  d.param_copy_dtype = copy;
  return o;
}

Status ValidateStepKernelOptions(const StepKernelOptions& o) {
  if (o.type == "lion") return kernels::ValidateLionOptions(o.lion);
  if (o.type == "adagrad") return kernels::ValidateAdagradOptions(o.adagrad);
  return kernels::ValidateAdamOptions(o.adam);
}

GpuUpdateChoice ChooseGpuUpdate(const GpuUpdateFacts& f) {
  if (!f.device_on_gpu) return {false, "no GPU (the device tier is a host arena, updated in place)", false};
  for (int s = 0; s < kNumStates; ++s)
    if (IsOptimizerState(s) && f.used[static_cast<size_t>(s)] &&
        f.home[static_cast<size_t>(s)] != TierKind::kDevice)
      return {false, "the optimizer state is not homed on the device", false};
  if (f.setting == "off") return {false, "strata.gpu_optimizer is \"off\"", false};
  if (!f.cuda_built) return {false, "this build has no CUDA kernels", true};
  // Compact: P's slice is the master's bf16 half, a state the step rewrites;
  // the GPU updates it in place only (no staging of it through the scratch).
  if (f.compact && f.home[int(StateKind::kP)] != TierKind::kDevice)
    return {false,
            "compact state (strata.state_format \"compact\") is updated on the GPU only with P (the master's "
            "bf16 half) homed on the device too (offload_param \"none\")",
            true};
  if (f.compact && f.optimizer != "adam" && f.optimizer != "adamw" && f.optimizer != "lion")
    return {false, "optimizer.type \"" + f.optimizer + "\" has no compact CUDA kernel", true};
  if (f.optimizer != "adam" && f.optimizer != "adamw" && f.optimizer != "lion" && f.optimizer != "adagrad")
    return {false, "optimizer.type \"" + f.optimizer + "\" has no CUDA kernel", true};
  return {true, "", false};
}

bool OptimizerStateOnDevice(const std::array<StateBlock, kNumStates>& blocks) {
  bool any = false;
  for (int s = 0; s < kNumStates; ++s) {
    const StateBlock& b = blocks[static_cast<size_t>(s)];
    if (!IsOptimizerState(s) || b.alloc.charged == 0) continue;
    if (b.home != TierKind::kDevice) return false;
    any = true;
  }
  return any;
}

GpuScratchPlan PlanGpuScratch(uint64_t largest_shard_numel, DType grad, DType compute, bool p_on_device) {
  GpuScratchPlan p;
  p.g_bytes = largest_shard_numel * DTypeSize(grad);
  p.p_offset = AlignUp(p.g_bytes, kDeviceGrain);
  if (!p_on_device && compute != DType::kF32) p.p_bytes = largest_shard_numel * DTypeSize(compute);
  p.total = p.p_offset + AlignUp(p.p_bytes, kDeviceGrain);
  return p;
}

bool GpuScratchFits(uint64_t budget_left, const GpuScratchPlan& plan, uint64_t p_copy_reserve) {
  return plan.total > 0 && plan.total <= budget_left && p_copy_reserve <= budget_left - plan.total;
}

Status StepKernelCpu(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                     void* param_copy) {
  if (o.type == "lion") return kernels::LionStep(o.lion, n, w, m, g, param_copy);
  if (o.type == "adagrad") return kernels::AdagradStep(o.adagrad, n, w, m, g, param_copy);
  return kernels::AdamStep(o.adam, n, w, m, v, g, param_copy);
}

Status StepKernelCuda(const StepKernelOptions& o, uint64_t n, float* w, float* m, float* v, const void* g,
                      void* param_copy, void* stream) {
#if STRATA_HAVE_CUDA
  if (o.type == "lion") return kernels::LionStepCuda(o.lion, n, w, m, g, param_copy, stream);
  if (o.type == "adagrad") return kernels::AdagradStepCuda(o.adagrad, n, w, m, g, param_copy, stream);
  return kernels::AdamStepCuda(o.adam, n, w, m, v, g, param_copy, stream);
#else
  (void)o, (void)n, (void)w, (void)m, (void)v, (void)g, (void)param_copy, (void)stream;
  return UnsupportedError("the optimizer on the GPU: this build of Strata has no CUDA");
#endif
}

Status CompactStepKernelCpu(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g) {
  if (o.type == "lion") return kernels::CompactLionStep(o.lion, n, s, g, nullptr);
  return kernels::CompactAdamStep(o.adam, n, s, g, nullptr);
}

Status CompactStepKernelCuda(const StepKernelOptions& o, uint64_t n, const kernels::CompactState& s, const void* g,
                             void* stream) {
#if STRATA_HAVE_CUDA
  if (o.type == "lion") return kernels::CompactLionStepCuda(o.lion, n, s, g, nullptr, stream);
  return kernels::CompactAdamStepCuda(o.adam, n, s, g, nullptr, stream);
#else
  (void)o, (void)n, (void)s, (void)g, (void)stream;
  return UnsupportedError("the compact optimizer on the GPU: this build of Strata has no CUDA");
#endif
}

Status DeviceCopyF32(const float* src, float* dst, uint64_t n, void* stream) {
#if STRATA_HAVE_CUDA
  return kernels::CastCuda(DType::kF32, src, DType::kF32, dst, n, stream);
#else
  (void)src, (void)dst, (void)n, (void)stream;
  return UnsupportedError("device copy: this build of Strata has no CUDA");
#endif
}

}  // namespace strata
